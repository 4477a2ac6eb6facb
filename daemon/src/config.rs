//! The host configuration: `config.toml` in the home directory, layered
//! defaults → file → environment (design README "Files, configuration and keys").
//!
//! This module owns the settings' names, defaults, validation and the environment variables
//! that override them. Every setting has a default (a named function below), so a missing file
//! is a valid configuration; an unknown key anywhere in the file is refused with an error that
//! names it, never ignored. Command-line flags, where a command has them, override the result
//! (applied by the command, after [`Config::load`]).
//!
//! It must never write the file except to record the host name and the key store at `init`
//! ([`record_host`], [`record_key_store`]) and the relay ([`set_relay`]), and never hold or
//! print secrets: the file carries none (keys live in the key store, [`crate::keystore`]).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fsutil;
use crate::host_name::HostName;
use crate::paths::Paths;

pub mod hooks;

/// Overrides [`Config::api_port`].
pub const API_PORT_ENV: &str = "MBX_API_PORT";
/// Overrides [`Config::api_bind`].
pub const API_BIND_ENV: &str = "MBX_API_BIND";
/// Overrides [`Config::lan_port`].
pub const LAN_PORT_ENV: &str = "MBX_LAN_PORT";
/// Overrides [`Config::lan_bind`].
pub const LAN_BIND_ENV: &str = "MBX_LAN_BIND";
/// Overrides [`Config::advertise`] (0.5.x `MBX_ADVERTISE`).
pub const ADVERTISE_ENV: &str = "MBX_ADVERTISE";
/// Overrides [`Config::self_addrs`]: comma-separated IPs (0.5.x `MBX_SELF_ADDRS`).
pub const SELF_ADDRS_ENV: &str = "MBX_SELF_ADDRS";
/// `MBX_NO_MDNS=1` turns mDNS off ([`Config::mdns`] = false), as in 0.5.x.
pub const NO_MDNS_ENV: &str = "MBX_NO_MDNS";
/// Overrides the relay URL ([`RelayConfig::url`]); a pinned key from the file is kept only when
/// the URL is the same.
pub const RELAY_URL_ENV: &str = "MBX_RELAY_URL";
/// Overrides [`Config::relay_pull_interval_ms`].
pub const RELAY_PULL_INTERVAL_ENV: &str = "MBX_RELAY_PULL_INTERVAL_MS";

/// Overrides [`Config::relay_stream`]: `0` (or `false`, `off`, `no`) turns the push stream
/// off, `1` (or `true`, `on`, `yes`) on.
pub const RELAY_STREAM_ENV: &str = "MBX_RELAY_STREAM";

/// The daemon's log filter; wins over [`Config::log_level`] (applied by the binary's logger,
/// not by [`Config::apply_env`]).
pub const LOG_ENV: &str = "MBX_LOG";

/// Each environment variable that overrides a `config.toml` setting, with the setting's
/// (dotted) key. A daemon started by a service manager sees none of them unless the service
/// file sets them.
pub const ENV_KEYS: &[(&str, &str)] = &[
    (API_PORT_ENV, "api_port"),
    (API_BIND_ENV, "api_bind"),
    (LAN_PORT_ENV, "lan_port"),
    (LAN_BIND_ENV, "lan_bind"),
    (ADVERTISE_ENV, "advertise"),
    (SELF_ADDRS_ENV, "self_addrs"),
    (NO_MDNS_ENV, "mdns"),
    (RELAY_URL_ENV, "relay.url"),
    (RELAY_PULL_INTERVAL_ENV, "relay_pull_interval_ms"),
    (RELAY_STREAM_ENV, "relay_stream"),
    (LOG_ENV, "log_level"),
];

/// Shortest relay pull interval accepted (ms): below it an idle host would hammer its relay.
pub const MIN_RELAY_PULL_INTERVAL_MS: u64 = 100;
/// Longest relay pull interval accepted (ms, one hour): beyond it relayed mail looks lost.
pub const MAX_RELAY_PULL_INTERVAL_MS: u64 = 3_600_000;

/// Default local API port (loopback HTTP for agents).
pub fn default_api_port() -> u16 {
    7375
}

/// Default local API bind address: loopback only (design README "Local API").
pub fn default_api_bind() -> IpAddr {
    IpAddr::V4(Ipv4Addr::LOCALHOST)
}

/// Default LAN port for host-to-host delivery (`wire.md` §5 `init --port 7373`).
pub fn default_lan_port() -> u16 {
    7373
}

/// Default LAN bind address: every IPv4 interface, so paired hosts can reach this one
/// (`wire.md` §4, 0.5.x `config.bind`). Tests bind 127.0.0.1 or an address in their own namespace.
pub fn default_lan_bind() -> IpAddr {
    IpAddr::V4(Ipv4Addr::UNSPECIFIED)
}

fn default_true() -> bool {
    true
}

/// Default relay pull interval in ms (design README: 2 s until live push exists).
pub fn default_relay_pull_interval_ms() -> u64 {
    2000
}

/// The host configuration after layering. Field docs give the TOML key, unit and default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `host`: this host's name ([`HostName`] rule). Absent until `init` records it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostName>,
    /// `api_port`: TCP port of the local API (default 7375; 0 picks a free port).
    #[serde(default = "default_api_port")]
    pub api_port: u16,
    /// `api_bind`: IP address the local API binds (default 127.0.0.1).
    #[serde(default = "default_api_bind")]
    pub api_bind: IpAddr,
    /// `lan_port`: TCP port for LAN delivery between paired hosts (default 7373; 0 picks a
    /// free port).
    #[serde(default = "default_lan_port")]
    pub lan_port: u16,
    /// `lan_bind`: IP address the LAN server binds (default 0.0.0.0). A loopback bind also
    /// turns mDNS off.
    #[serde(default = "default_lan_bind")]
    pub lan_bind: IpAddr,
    /// `advertise`: the `host:port` this host gives peers at pairing (default
    /// `<hostname>.local:<lan port>`; `wire.md` §2.7).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// `self_addrs`: this host's own LAN IPs as signed in status and presence (default: the
    /// non-internal IPv4 addresses of its interfaces; `wire.md` §2.7).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub self_addrs: Vec<IpAddr>,
    /// `mdns`: advertise and browse `_agentmbx._tcp.local` (default true; off with
    /// `MBX_NO_MDNS=1` or a loopback `lan_bind`).
    #[serde(default = "default_true")]
    pub mdns: bool,
    /// `hook_concurrency`: most `[[hooks]]` commands running at once (default 4, 1..=64;
    /// [`hooks`]).
    #[serde(default = "hooks::default_concurrency")]
    pub hook_concurrency: u32,
    /// `[relay]`: the relay this host pushes to and pulls from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<RelayConfig>,
    /// `relay_pull_interval_ms`: pause between relay pulls when idle, in ms (default 2000,
    /// accepted [`MIN_RELAY_PULL_INTERVAL_MS`]..=[`MAX_RELAY_PULL_INTERVAL_MS`]).
    #[serde(default = "default_relay_pull_interval_ms")]
    pub relay_pull_interval_ms: u64,
    /// `relay_stream`: keep the relay's push stream open (`docs/relay-stream.md`; default
    /// true). While it is up the periodic pull stops; off, or where the relay does not offer
    /// it, the daemon pulls every `relay_pull_interval_ms`. [`RELAY_STREAM_ENV`] overrides it.
    #[serde(default = "default_true")]
    pub relay_stream: bool,
    /// `key_store`: where private keys are kept (`"keyring"` or `"file"`), chosen at `init`
    /// (`MBX_KEYSTORE`, else this key, else the OS keyring when it answers) and never switched
    /// silently afterwards ([`crate::keystore`]). Default `"file"` for a home that records none.
    #[serde(default)]
    pub key_store: KeyStore,
    /// `log_level`: the daemon's log filter (tracing `EnvFilter` syntax, e.g. `"debug"` or
    /// `"info,agentmbx::transport=debug"`, at most [`MAX_LOG_LEVEL_BYTES`]); `MBX_LOG` wins
    /// over it. Default: unset (`info`). Applied without a restart when the file changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
    /// `[[hooks]]`: commands run for new mail ([`hooks`]); read at start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<hooks::HookConfig>,
    /// `[api_rate]`: the local API's rate classes ([`ApiRateConfig`]; issue 19 part 4). Read
    /// at start (a change needs a restart).
    #[serde(default, skip_serializing_if = "ApiRateConfig::is_default")]
    pub api_rate: ApiRateConfig,
}

/// `[api_rate]` in `config.toml`: one token bucket per (agent, class) on the local API
/// ([`crate::api::rate`]; seed 001 "Rate limiting"). Each class has a burst (tokens a full
/// bucket holds) and a refill rate (tokens per minute, continuous). The defaults are several
/// times the relay's per-IP ones (seed 001: poll 30 + 2/s, send 20 + 1/s, register 10 + 0.5/s)
/// because every agent of the host shares this one loopback API: an agent in a tight
/// `mbx_wait` loop, or sending a burst of 20 messages, never meets them, while one runaway
/// loop is held to the refill rate and leaves the other agents' buckets alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiRateConfig {
    /// `wait_burst`: reads that poll (`GET /v1/inbox` with or without `wait`, `/v1/catchup`,
    /// `/v1/replay`, `/v1/sent`) and opening an event stream (`/v1/events`): tokens (default
    /// 120).
    pub wait_burst: u64,
    /// `wait_per_min`: their refill, tokens per minute (default 1200: 20 a second).
    pub wait_per_min: u64,
    /// `send_burst`: `POST /v1/messages` and `POST /v1/messages/{id}/reply` (default 40).
    pub send_burst: u64,
    /// `send_per_min`: their refill, tokens per minute (default 240: 4 a second).
    pub send_per_min: u64,
    /// `register_burst`: `POST /v1/agents` (default 20).
    pub register_burst: u64,
    /// `register_per_min`: its refill, tokens per minute (default 60: 1 a second).
    pub register_per_min: u64,
    /// `other_burst`: every other authenticated request (read one message, thread, search, ack,
    /// agents list, unclaimed, wakes, catchup commit and restart; default 120).
    pub other_burst: u64,
    /// `other_per_min`: its refill, tokens per minute (default 1200: 20 a second).
    pub other_per_min: u64,
    /// `max_keys`: agents each class's table holds at most (default 4096); a bucket that has
    /// refilled completely is forgotten first, and past that a new agent is answered 429
    /// until the earliest bucket refills (never an existing bucket dropped).
    pub max_keys: u64,
}

/// Bounds of the `[api_rate]` keys, `(key, min, max)`: bursts 1..=1,000,000 tokens, rates
/// 1..=6,000,000 tokens a minute (100,000 a second; a zero rate would refuse everything), and
/// 1..=1,000,000 keys per table (each costs about a hundred bytes).
pub const API_RATE_RANGES: [(&str, u64, u64); 9] = [
    ("api_rate.wait_burst", 1, 1_000_000),
    ("api_rate.wait_per_min", 1, 6_000_000),
    ("api_rate.send_burst", 1, 1_000_000),
    ("api_rate.send_per_min", 1, 6_000_000),
    ("api_rate.register_burst", 1, 1_000_000),
    ("api_rate.register_per_min", 1, 6_000_000),
    ("api_rate.other_burst", 1, 1_000_000),
    ("api_rate.other_per_min", 1, 6_000_000),
    ("api_rate.max_keys", 1, 1_000_000),
];

impl Default for ApiRateConfig {
    fn default() -> Self {
        ApiRateConfig {
            wait_burst: 120,
            wait_per_min: 1200,
            send_burst: 40,
            send_per_min: 240,
            register_burst: 20,
            register_per_min: 60,
            other_burst: 120,
            other_per_min: 1200,
            max_keys: 4096,
        }
    }
}

impl ApiRateConfig {
    /// Whether every key has its default (then the table is not written out).
    pub fn is_default(&self) -> bool {
        *self == ApiRateConfig::default()
    }

    /// Each key (without the `api_rate.` prefix) with its value, in [`API_RATE_RANGES`] order,
    /// e.g. `[("wait_burst", 60), …]` (what a change of the table logs).
    pub fn values_by_key(&self) -> Vec<(&'static str, u64)> {
        API_RATE_RANGES
            .iter()
            .zip(self.values())
            .map(|((key, _, _), v)| (key.trim_start_matches("api_rate."), v))
            .collect()
    }

    /// The values in [`API_RATE_RANGES`] order.
    fn values(&self) -> [u64; 9] {
        [
            self.wait_burst,
            self.wait_per_min,
            self.send_burst,
            self.send_per_min,
            self.register_burst,
            self.register_per_min,
            self.other_burst,
            self.other_per_min,
            self.max_keys,
        ]
    }

    /// The first key out of its [`API_RATE_RANGES`] bounds, with the message, e.g.
    /// `("api_rate.send_burst", "0 is outside 1..=1000000")`.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        for ((key, min, max), value) in API_RATE_RANGES.iter().zip(self.values()) {
            if !(*min..=*max).contains(&value) {
                return Err((key, format!("{value} is outside {min}..={max}")));
            }
        }
        Ok(())
    }
}

/// Longest `log_level` accepted (bytes).
pub const MAX_LOG_LEVEL_BYTES: usize = 1024;

impl Default for Config {
    fn default() -> Self {
        Config {
            host: None,
            api_port: default_api_port(),
            api_bind: default_api_bind(),
            lan_port: default_lan_port(),
            lan_bind: default_lan_bind(),
            advertise: None,
            self_addrs: Vec::new(),
            mdns: true,
            relay: None,
            relay_pull_interval_ms: default_relay_pull_interval_ms(),
            relay_stream: true,
            key_store: KeyStore::default(),
            log_level: None,
            hook_concurrency: hooks::DEFAULT_CONCURRENCY,
            hooks: Vec::new(),
            api_rate: ApiRateConfig::default(),
        }
    }
}

/// `[relay]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// `url`: base URL of the relay, `http://` or `https://`.
    pub url: String,
    /// `key`: the relay's pinned Ed25519 public key, standard base64 (44 characters). When
    /// absent the key is learned on first contact (`wire.md` §3.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// `token_command`: for a relay run with the account authority (spec §8), a command line
    /// (run with `sh -c`) that prints a fresh account token for this relay on stdout
    /// ([`crate::transport::relay_client::account`]: environment, time and size limits). When
    /// absent the host enrols with the host-key challenge only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_command: Option<String>,
}

/// Longest relay URL accepted (bytes).
pub const MAX_RELAY_URL_BYTES: usize = 2048;

/// A relay URL that cannot be used ([`check_relay_url`]). The message shows the URL only with
/// control and non-ASCII characters escaped and never shows user information (a password).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRelayUrl(String);

/// `text` for an error message: at most 100 characters, in quotes, every character outside
/// printable ASCII (control, whitespace other than the space, bidi and other format
/// characters, any non-ASCII) escaped as `\u{…}`, so a message never carries terminal control
/// sequences or reordered text.
pub fn shown(text: &str) -> String {
    let mut out = String::from("\"");
    for (i, c) in text.chars().enumerate() {
        if i == 100 {
            out.push_str("...");
            break;
        }
        out.extend(c.escape_default());
    }
    out.push('"');
    out
}

/// Checks a relay base URL (`[relay] url`, `MBX_RELAY_URL`, `relay set`) and returns its
/// normal form: the text without trailing slashes. Accepted: `http://` or `https://`, a host
/// and an optional port 1..=65535, an optional path of plain segments; at most
/// [`MAX_RELAY_URL_BYTES`] of printable ASCII (an international host name in punycode).
/// Refused, with a message that says why: user information (`user:password@`: it would be
/// stored in `config.toml` and shown by `relay info` and in logs), whitespace, control,
/// non-ASCII or format characters, a query or fragment, backslashes, percent-escapes, empty
/// segments and dot segments (`.`/`..`: the URL must name the relay as given, not a path the
/// HTTP client rewrites), a port that is not a number in 1..=65535.
pub fn check_relay_url(text: &str) -> Result<String, BadRelayUrl> {
    let bad = |why: &str| Err(BadRelayUrl(format!("relay URL {}: {why}", shown(text))));
    if text.is_empty() {
        return Err(BadRelayUrl("the relay URL is empty".into()));
    }
    if text.len() > MAX_RELAY_URL_BYTES {
        return Err(BadRelayUrl(format!(
            "the relay URL is longer than {MAX_RELAY_URL_BYTES} bytes"
        )));
    }
    if let Some(c) = text.chars().find(|c| !c.is_ascii_graphic()) {
        let what = if c == ' ' || c.is_whitespace() {
            "whitespace"
        } else if c.is_control() {
            "a control character"
        } else {
            "a non-ASCII character (give an international host name in punycode)"
        };
        let which = if c == ' ' {
            "a space".to_string()
        } else {
            c.escape_default().to_string()
        };
        return bad(&format!("contains {what} ({which})"));
    }
    let Some(rest) = text
        .strip_prefix("http://")
        .or_else(|| text.strip_prefix("https://"))
    else {
        return bad("must start with http:// or https://");
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if authority.contains('@') {
        // Not shown: the text may hold a password.
        return Err(BadRelayUrl(
            "the relay URL must not carry a user name or password (user:password@host): they would be stored in config.toml and shown by `relay info` and in logs".into(),
        ));
    }
    if authority.is_empty() {
        return bad("names no host");
    }
    if text.contains('?') || text.contains('#') {
        return bad("must not have a query (?) or fragment (#)");
    }
    if text.contains('\\') || text.contains('%') {
        return bad("must not contain backslashes or percent-escapes");
    }
    let path = path.trim_end_matches('/');
    if path
        .split('/')
        .skip(1)
        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return bad("its path must be plain segments (no //, . or ..)");
    }
    // The port follows the last colon outside an IPv6 literal's brackets.
    let port = match authority.rfind(':') {
        Some(i) if !authority[i..].contains(']') => Some(&authority[i + 1..]),
        _ => None,
    };
    if let Some(port) = port {
        let number = (port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit()))
            .then(|| port.parse::<u16>().ok())
            .flatten();
        if number.is_none_or(|n| n == 0) {
            return bad("the port must be a number in 1..=65535");
        }
    }
    let normal = format!(
        "{}{}",
        &text[..text.len() - rest.len() + authority.len()],
        path
    );
    match reqwest::Url::parse(&normal) {
        Ok(url) if url.host_str().is_none_or(str::is_empty) => bad("names no host"),
        Ok(_) => Ok(normal),
        Err(e) => bad(&format!("not a valid URL ({e})")),
    }
}

/// Longest `relay.token_command` accepted (bytes).
pub const MAX_TOKEN_COMMAND_BYTES: usize = 4096;

/// Where the host's private keys are stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyStore {
    /// 0600 files `host.key` and `enc.key` in the home directory.
    #[default]
    File,
    /// The OS keyring (Secret Service, macOS Keychain, Windows Credential Manager), entries
    /// namespaced by the home directory.
    Keyring,
}

impl KeyStore {
    /// The config and `MBX_KEYSTORE` spelling: `"file"` or `"keyring"`.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyStore::File => "file",
            KeyStore::Keyring => "keyring",
        }
    }
}

impl std::fmt::Display for KeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The configuration could not be read, parsed, validated or written.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file exists but could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value of the wrong type.
    #[error("{path}{}: {message}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line of the fault, when known.
        line: Option<usize>,
        /// What is wrong, naming the key (e.g. "unknown key `foo`, expected one of …").
        message: String,
    },
    /// An overriding environment variable has a value that cannot be used.
    #[error("environment variable {var}: {message}")]
    Env {
        /// The variable's name.
        var: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// A setting has a value outside what it accepts (after layering). Shown as
    /// ``<file> line <n>: `<key>`: <message>`` when the value comes from a file, else as
    /// ``config setting `<key>`: <message>``.
    #[error("{}", invalid_text(key, message, path.as_deref(), *line))]
    Invalid {
        /// The TOML key (dotted for tables, e.g. `relay.url`).
        key: &'static str,
        /// What is wrong.
        message: String,
        /// The file the value comes from; `None` when it comes from the environment or the
        /// file is not known.
        path: Option<PathBuf>,
        /// 1-based line of the key in `path`, when found.
        line: Option<usize>,
    },
    /// `init` was asked for another name than the one the file already records.
    #[error("{path} already names this host {existing:?}; run init with --host {existing} or edit the file")]
    HostConflict {
        /// The file.
        path: PathBuf,
        /// The name in the file.
        existing: HostName,
    },
    /// The file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl Config {
    /// Loads `config.toml` from `paths` (defaults when the file is missing), then applies the
    /// process environment, then validates. Errors: [`ConfigError`].
    pub fn load(paths: &Paths) -> Result<Config, ConfigError> {
        Self::load_with_env(paths, |var| std::env::var(var).ok())
    }

    /// As [`Config::load`] with an explicit environment lookup (tests).
    pub fn load_with_env(
        paths: &Paths,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut config = Self::check_file(&paths.config_file())?.unwrap_or_default();
        config.apply_env(env)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and parses the file alone (no environment). `Ok(None)` when it does not exist.
    pub fn read_file(path: &Path) -> Result<Option<Config>, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::from_toml_str(&text, path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Parses TOML text; `path` is used in error messages only. A value of the wrong type is
    /// reported with its key and line, in words rather than Rust types ("a port number
    /// 0-65535", not "u16").
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
            let mut message = plain_message(e.message());
            if let Some(key) = line.and_then(|l| key_at_line(text, l)) {
                if !message.contains(&format!("`{key}`"))
                    && !message.contains(&format!("`{}`", key.rsplit('.').next().unwrap_or("")))
                {
                    message = format!("`{key}`: {message}");
                }
            }
            ConfigError::Parse {
                path: path.to_path_buf(),
                line,
                message,
            }
        })
    }

    /// Applies the `MBX_*` overrides listed as constants in this module. Empty values count as
    /// unset. Errors: [`ConfigError::Env`] naming the variable.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let get = |var: &str| env(var).filter(|v| !v.trim().is_empty());
        if let Some(v) = get(API_PORT_ENV) {
            self.api_port = parse_env(API_PORT_ENV, &v)?;
        }
        if let Some(v) = get(API_BIND_ENV) {
            self.api_bind = parse_env(API_BIND_ENV, &v)?;
        }
        if let Some(v) = get(LAN_PORT_ENV) {
            self.lan_port = parse_env(LAN_PORT_ENV, &v)?;
        }
        if let Some(v) = get(LAN_BIND_ENV) {
            self.lan_bind = parse_env(LAN_BIND_ENV, &v)?;
        }
        if let Some(v) = get(ADVERTISE_ENV) {
            self.advertise = Some(v.trim().to_string());
        }
        if let Some(v) = get(SELF_ADDRS_ENV) {
            self.self_addrs = v
                .split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(|a| parse_env(SELF_ADDRS_ENV, a))
                .collect::<Result<_, _>>()?;
        }
        if let Some(v) = get(NO_MDNS_ENV) {
            if v.trim() != "0" {
                self.mdns = false;
            }
        }
        if let Some(v) = get(RELAY_PULL_INTERVAL_ENV) {
            self.relay_pull_interval_ms = parse_env(RELAY_PULL_INTERVAL_ENV, &v)?;
        }
        if let Some(v) = get(RELAY_STREAM_ENV) {
            self.relay_stream = match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "on" | "yes" => true,
                "0" | "false" | "off" | "no" => false,
                _ => {
                    return Err(ConfigError::Env {
                        var: RELAY_STREAM_ENV,
                        message: format!("{v:?}: expected 0 or 1 (or false/true, off/on, no/yes)"),
                    })
                }
            };
        }
        if let Some(url) = get(RELAY_URL_ENV) {
            let url = url.trim().to_string();
            let key = match &self.relay {
                Some(r) if r.url == url => r.key.clone(),
                _ => None,
            };
            // The token command is told which relay it serves: it stays.
            let token_command = self.relay.as_ref().and_then(|r| r.token_command.clone());
            self.relay = Some(RelayConfig {
                url,
                key,
                token_command,
            });
        }
        Ok(())
    }

    /// Checks values that their types alone do not constrain. Errors: [`ConfigError::Invalid`]
    /// (without a file: [`Config::check_file`] adds it).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &'static str, message: String| ConfigError::Invalid {
            key,
            message,
            path: None,
            line: None,
        };
        self.api_rate
            .check()
            .map_err(|(key, message)| invalid(key, message))?;
        let range = MIN_RELAY_PULL_INTERVAL_MS..=MAX_RELAY_PULL_INTERVAL_MS;
        if !range.contains(&self.relay_pull_interval_ms) {
            return Err(invalid(
                "relay_pull_interval_ms",
                format!(
                    "{} ms is outside {MIN_RELAY_PULL_INTERVAL_MS}..={MAX_RELAY_PULL_INTERVAL_MS} ms",
                    self.relay_pull_interval_ms
                ),
            ));
        }
        if let Some(level) = &self.log_level {
            if level.trim().is_empty() || level.len() > MAX_LOG_LEVEL_BYTES {
                return Err(invalid(
                    "log_level",
                    format!("must be a log filter of 1..={MAX_LOG_LEVEL_BYTES} bytes"),
                ));
            }
            tracing_subscriber::EnvFilter::try_new(level).map_err(|e| {
                invalid(
                    "log_level",
                    format!("{} is not a log filter ({e})", shown(level)),
                )
            })?;
        }
        hooks::validate(self.hook_concurrency, &self.hooks)
            .map_err(|(key, message)| invalid(key, message))?;
        if let Some(relay) = &self.relay {
            check_relay_url(&relay.url).map_err(|e| invalid("relay.url", e.to_string()))?;
            if let Some(key) = &relay.key {
                agentmbx_protocol::keys::PublicKey::from_b64(key).map_err(|_| {
                    invalid(
                        "relay.key",
                        format!(
                            "{} is not a relay public key: this setting wants the relay's \
                             Ed25519 public key in standard base64 (44 characters, as \
                             `agentmbx relay info` shows it), not its fingerprint; \
                             `agentmbx relay set <url> --key <fingerprint or key>` writes it",
                            shown(key)
                        ),
                    )
                })?;
            }
            if let Some(cmd) = &relay.token_command {
                if cmd.trim().is_empty()
                    || cmd.len() > MAX_TOKEN_COMMAND_BYTES
                    || cmd.contains('\0')
                {
                    return Err(invalid(
                        "relay.token_command",
                        format!(
                            "must be a command line of 1..={MAX_TOKEN_COMMAND_BYTES} bytes without NUL"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Reads, parses and validates the file alone (no environment): `Ok(None)` when it does
    /// not exist. Every error names the file, the key and, when it can be found, the line.
    /// Errors: [`ConfigError`].
    pub fn check_file(path: &Path) -> Result<Option<Config>, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let config = Self::from_toml_str(&text, path)?;
        config.validate().map_err(|e| match e {
            ConfigError::Invalid { key, message, .. } => ConfigError::Invalid {
                key,
                message,
                path: Some(path.to_path_buf()),
                line: key_line(&text, key),
            },
            other => other,
        })?;
        Ok(Some(config))
    }

    /// The LAN server's socket address (`lan_bind`:`lan_port`).
    pub fn lan_addr(&self) -> SocketAddr {
        SocketAddr::new(self.lan_bind, self.lan_port)
    }

    /// Whether mDNS runs: `mdns` is on and the LAN server is not bound to loopback.
    pub fn mdns_enabled(&self) -> bool {
        self.mdns && !self.lan_bind.is_loopback()
    }

    /// The local API's socket address (`api_bind`:`api_port`).
    pub fn api_addr(&self) -> SocketAddr {
        SocketAddr::new(self.api_bind, self.api_port)
    }
}

fn parse_env<T: std::str::FromStr>(var: &'static str, value: &str) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse().map_err(|e: T::Err| ConfigError::Env {
        var,
        message: format!("{value:?}: {e}"),
    })
}

/// The text of [`ConfigError::Invalid`].
fn invalid_text(key: &str, message: &str, path: Option<&Path>, line: Option<usize>) -> String {
    match path {
        Some(path) => format!(
            "{}{}: `{key}`: {message}",
            path.display(),
            line.map(|l| format!(" line {l}")).unwrap_or_default()
        ),
        None => format!("config setting `{key}`: {message}"),
    }
}

/// A TOML parse message in the words of this file's settings rather than Rust's types.
fn plain_message(message: &str) -> String {
    let mut out = message.trim().replacen("unknown field", "unknown key", 1);
    for (rust, words) in [
        ("expected u16", "expected a port number 0-65535"),
        ("expected u64", "expected a whole number of milliseconds"),
        ("expected struct RelayConfig", "expected a table"),
        ("expected a sequence", "expected an array"),
        (
            "invalid IP address syntax",
            "not an IP address (e.g. 127.0.0.1 or ::1)",
        ),
    ] {
        out = out.replace(rust, words);
    }
    out
}

/// The table name of a `[name]` header line (`None` for other lines; an array-of-tables
/// header `[[name]]` gives `"[name]"`, which names no table of this file).
fn header_name(line: &str) -> Option<String> {
    let t = line.trim_start();
    let rest = t.strip_prefix('[')?;
    let end = rest.find(']')?;
    Some(rest[..end].trim().trim_matches('"').to_string())
}

/// The key of a `key = value` line (`None` for blank, comment and header lines).
fn line_key(line: &str) -> Option<String> {
    let t = line.trim_start();
    if t.is_empty() || t.starts_with('#') || t.starts_with('[') {
        return None;
    }
    let eq = t.find('=')?;
    let key: String = t[..eq]
        .split('.')
        .map(|part| part.trim().trim_matches('"').trim_matches('\''))
        .collect::<Vec<_>>()
        .join(".");
    (!key.is_empty()).then_some(key)
}

/// The dotted key set on 1-based `line` of `text` (with its table), if that line sets one.
fn key_at_line(text: &str, line: usize) -> Option<String> {
    let mut table = String::new();
    for (i, l) in text.lines().enumerate() {
        if let Some(name) = header_name(l) {
            table = name;
        }
        if i + 1 == line {
            let key = line_key(l)?;
            return Some(if table.is_empty() {
                key
            } else {
                format!("{table}.{key}")
            });
        }
    }
    None
}

/// The 1-based line of `text` that sets the dotted `key` (`relay.url`: `url` in `[relay]`,
/// or a top-level `relay.url`), if any.
fn key_line(text: &str, key: &str) -> Option<usize> {
    (1..=text.lines().count()).find(|&l| key_at_line(text, l).as_deref() == Some(key))
}

/// Records `host` as this host's name in `config.toml` (`init`). Creates the file when missing
/// (with `host` only: the key store is recorded once the keys exist, [`record_key_store`]); adds a `host` line to an existing file that has none,
/// keeping everything else byte for byte; does nothing when the file already names `host`.
/// Errors: [`ConfigError::HostConflict`] when the file names another host; parse and I/O errors.
pub fn record_host(paths: &Paths, host: &HostName) -> Result<(), ConfigError> {
    let path = paths.config_file();
    let write_err = |source| ConfigError::Write {
        path: path.clone(),
        source,
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let text = format!(
                "# agentmbx host configuration. Every setting has a default; unknown keys are refused.\n\
                 host = \"{host}\"\n"
            );
            return fsutil::create_new(&path, text.as_bytes(), fsutil::PRIVATE_MODE)
                .map_err(write_err);
        }
        Err(source) => return Err(ConfigError::Read { path, source }),
    };
    let existing = Config::from_toml_str(&text, &path)?;
    match existing.host {
        Some(name) if &name == host => Ok(()),
        Some(name) => Err(ConfigError::HostConflict {
            path,
            existing: name,
        }),
        None => {
            // Top-level keys must precede every table header, so the new line goes first.
            let updated = format!("host = \"{host}\"\n{text}");
            fsutil::replace(&path, updated.as_bytes(), fsutil::PRIVATE_MODE).map_err(write_err)
        }
    }
}

/// Records `store` as the home's `key_store` in `config.toml` (`init`, once the keys exist):
/// replaces a top-level `key_store = …` line, or adds one after the file's opening comments,
/// keeping every other byte. The
/// file must exist ([`record_host`] runs first). Errors: parse and I/O errors.
pub fn record_key_store(paths: &Paths, store: KeyStore) -> Result<(), ConfigError> {
    let path = paths.config_file();
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
        path: path.clone(),
        source,
    })?;
    let line = format!("key_store = \"{store}\"");
    let mut lines: Vec<&str> = text.lines().collect();
    let top = lines
        .iter()
        .position(|l| l.trim_start().starts_with('['))
        .unwrap_or(lines.len());
    let existing = lines[..top].iter().position(|l| {
        l.trim_start()
            .strip_prefix("key_store")
            .is_some_and(|rest| rest.trim_start().starts_with('='))
    });
    match existing {
        Some(i) if lines[i].trim() == line => return Ok(()),
        Some(i) => lines[i] = &line,
        // After the comment block that opens the file (init's header stays first).
        None => {
            let at = lines[..top]
                .iter()
                .position(|l| !l.trim_start().starts_with('#'))
                .unwrap_or(top);
            lines.insert(at, &line)
        }
    }
    let mut updated = lines.join("\n");
    updated.push('\n');
    Config::from_toml_str(&updated, &path)?;
    fsutil::replace(&path, updated.as_bytes(), fsutil::PRIVATE_MODE)
        .map_err(|source| ConfigError::Write { path, source })
}

/// Sets (or, with `None`, removes) the `[relay]` table of `config.toml`, keeping every other
/// byte of the file: comments, blank lines, order and the other settings. Inside the table,
/// the `url` and `key` lines are replaced in place (an inline comment after the value stays),
/// a key the file lacks is added after the table's last setting, a `key` no longer wanted is
/// removed; with no `[relay]` table one is appended at the end. `None` removes the table's
/// header and settings. A given table without `token_command` keeps the one the file has
/// (`relay set` changes the URL and the pin, not how tokens are obtained). The result is
/// parsed and compared with the intended settings before it is written (a file that sets the
/// relay some other way, e.g. as an inline table, is re-serialised instead, without its
/// comments); the file is replaced atomically. Errors: parse, validation and I/O errors.
pub fn set_relay(paths: &Paths, relay: Option<&RelayConfig>) -> Result<(), ConfigError> {
    let path = paths.config_file();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(source) => return Err(ConfigError::Read { path, source }),
    };
    let current = Config::from_toml_str(&text, &path)?;
    let kept_command = current.relay.as_ref().and_then(|r| r.token_command.clone());
    let merged = relay.map(|r| RelayConfig {
        token_command: r.token_command.clone().or(kept_command),
        ..r.clone()
    });
    let intended = Config {
        relay: merged.clone(),
        ..current
    };
    let edited = edit_relay_table(&text, merged.as_ref());
    let updated = match Config::from_toml_str(&edited, &path) {
        Ok(c) if c == intended => edited,
        _ => reserialised(&text, merged.as_ref(), &path)?,
    };
    Config::from_toml_str(&updated, &path)?.validate()?;
    fsutil::replace(&path, updated.as_bytes(), fsutil::PRIVATE_MODE)
        .map_err(|source| ConfigError::Write { path, source })
}

/// A TOML basic string holding `value`, escaped.
fn toml_string(value: &str) -> String {
    toml::Value::String(value.to_string()).to_string()
}

/// The part of a `key = value` line after its value: whitespace and an inline comment, when
/// the value is a one-line string whose end can be found; otherwise empty.
fn inline_comment(line: &str) -> &str {
    let Some(eq) = line.find('=') else {
        return "";
    };
    let value = line[eq + 1..].trim_start();
    let start = line.len() - value.len();
    let end = if value.starts_with("\"\"\"") || value.starts_with("'''") {
        None
    } else if let Some(body) = value.strip_prefix('"') {
        let mut escaped = false;
        body.char_indices()
            .find(|&(_, c)| {
                let close = c == '"' && !escaped;
                escaped = c == '\\' && !escaped;
                close
            })
            .map(|(i, _)| i + 2)
    } else if let Some(body) = value.strip_prefix('\'') {
        body.find('\'').map(|i| i + 2)
    } else {
        None
    };
    match end.map(|e| &line[start + e..]) {
        Some(rest) if rest.trim_start().starts_with('#') => rest,
        _ => "",
    }
}

/// `text` with its `[relay]` table set to `relay` (or removed), line by line; see
/// [`set_relay`]. The caller checks the result.
fn edit_relay_table(text: &str, relay: Option<&RelayConfig>) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let header = lines
        .iter()
        .position(|l| header_name(l).as_deref() == Some("relay"));
    let wanted: Vec<(&str, Option<&String>)> = match relay {
        Some(r) => vec![
            ("url", Some(&r.url)),
            ("key", r.key.as_ref()),
            ("token_command", r.token_command.as_ref()),
        ],
        None => Vec::new(),
    };
    match header {
        None if relay.is_none() => return text.to_string(),
        None => {
            if lines.last().is_some_and(|l| !l.trim().is_empty()) {
                lines.push(String::new());
            }
            lines.push("[relay]".into());
            for (key, value) in &wanted {
                if let Some(v) = value {
                    lines.push(format!("{key} = {}", toml_string(v)));
                }
            }
        }
        Some(h) => {
            let end = lines[h + 1..]
                .iter()
                .position(|l| header_name(l).is_some())
                .map_or(lines.len(), |i| h + 1 + i);
            // The table's last setting: comments after it belong to what follows.
            let last = (h + 1..end)
                .rev()
                .find(|&i| line_key(&lines[i]).is_some())
                .unwrap_or(h);
            if relay.is_none() {
                lines.drain(h..=last);
                // No blank line left doubled where the table was, nor one at the end.
                if h > 0 && h == lines.len() && lines[h - 1].trim().is_empty() {
                    lines.pop();
                } else if h > 0
                    && lines.get(h).is_some_and(|l| l.trim().is_empty())
                    && lines[h - 1].trim().is_empty()
                {
                    lines.remove(h);
                }
            } else {
                let mut table: Vec<String> = lines[h..=last].to_vec();
                for (key, value) in &wanted {
                    let at = table
                        .iter()
                        .position(|l| line_key(l).as_deref() == Some(*key));
                    match (at, value) {
                        (Some(i), Some(v)) => {
                            let comment = inline_comment(&table[i]).to_string();
                            let indent: String =
                                table[i].chars().take_while(|c| c.is_whitespace()).collect();
                            table[i] = format!("{indent}{key} = {}{comment}", toml_string(v));
                        }
                        (Some(i), None) => {
                            table.remove(i);
                        }
                        (None, Some(v)) => table.push(format!("{key} = {}", toml_string(v))),
                        (None, None) => {}
                    }
                }
                lines.splice(h..=last, table);
            }
        }
    }
    let mut out = lines.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out
}

/// `text` re-serialised with `[relay]` set to `relay`: the fallback of [`set_relay`] for a
/// file that sets the relay in a form the line edit does not handle (comments are lost).
fn reserialised(
    text: &str,
    relay: Option<&RelayConfig>,
    path: &Path,
) -> Result<String, ConfigError> {
    let parse_err = |message: String| ConfigError::Parse {
        path: path.to_path_buf(),
        line: None,
        message,
    };
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| parse_err(e.to_string()))?;
    match relay {
        Some(r) => {
            let value = toml::Value::try_from(r).map_err(|e| parse_err(e.to_string()))?;
            table.insert("relay".into(), value);
        }
        None => {
            table.remove("relay");
        }
    }
    toml::to_string(&table).map_err(|e| parse_err(e.to_string()))
}

#[cfg(test)]
mod tests;
