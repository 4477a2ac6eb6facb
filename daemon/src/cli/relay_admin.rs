//! `agentmbx relay revoke` and `agentmbx relay deny`: the relay operator's controls over
//! enrolments (spec §8 "Revocation"; design README "One process writes a store").
//!
//! Each runs one of two ways:
//! - **offline** on `--store-dir DIR` (or `MBX_RELAY_DIR`): opens the store itself, bound to the
//!   relay key its `relay.db` records, and refuses with exit code [`EXIT_RELAY_RUNNING`] while
//!   `relay serve` (or any other process) holds `relay.lock`;
//! - **online** with `--url <relay url>`: through the running relay's admin endpoints
//!   (`/v2/relay/admin/*`), with the admin token from `--admin-token-file`, else from
//!   `MBX_RELAY_ADMIN_TOKEN` (a flag beats the environment; never from the command line, where
//!   other users could read it). Errors name the token's source, never the token. The token
//!   goes over plain `http://` only to a loopback host (`localhost`, 127.0.0.0/8, `::1`);
//!   another host needs `https://`, or `--insecure-http` to send it anyway (exit 2 otherwise,
//!   before anything is sent).
//!
//! Offline, the relay-log receipt of the change is signed with the relay key: `MBX_RELAY_KEY`,
//! else `relay.key` in the store directory. When neither exists (the key lives only in a
//! platform secret), the change is still made — an emergency revocation must never wait for
//! the key — and its receipt is written unsigned, with one warning on stderr (`relay log`
//! marks it NOT VERIFIED). A malformed key is an error (exit 1): it must be fixed.
//!
//! Both run the same code in the relay crate ([`agentmbx_relay::admin`]). The next request of
//! a revoked or denied host is refused (403 REVOKED / DENIED); revocation is permanent and
//! survives re-enrolment and restarts, deny-list entries last until their `--until` or removal.
//!
//! Exit codes: 0 done, 1 failure (the relay refused, unreachable, wrong admin token), 2 usage
//! (a malformed argument — a client_id that is not printable ASCII, a mistyped fingerprint
//! without `--client` — or an `--until` shorter than the longest token lifetime), 3 nothing
//! matches (no such enrolment / deny entry, no store), 4 ([`EXIT_RELAY_RUNNING`]) the relay
//! runs on that store. A fingerprint that matches several enrolments is refused (exit 1),
//! listing them. This module never prints or logs the admin token.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use agentmbx_relay::admin::{self, AdminError, DenyView, RevokeReport};
use agentmbx_relay::config::{AdminToken, ADMIN_TOKEN_ENV};
use agentmbx_relay::store::DenyKind;

use super::{NotFoundError, UsageError};

/// The admin token's sources and transport, and the offline receipt's signature, shown after
/// the flags of `revoke` and `deny`.
macro_rules! token_help {
    () => {
        " With --url the admin token comes from --admin-token-file, else from \
MBX_RELAY_ADMIN_TOKEN (the flag wins). It is sent over plain http:// only to this machine \
(localhost, 127.0.0.0/8, ::1); another host needs https://, or --insecure-http. Offline, the \
relay-log receipt is signed with the relay key (MBX_RELAY_KEY, else relay.key in the store \
directory); without either the change is still made and the receipt is written unsigned, with \
a warning (relay log marks it NOT VERIFIED)."
    };
}

/// Exit code of an offline relay command refused because a relay runs on the store.
pub const EXIT_RELAY_RUNNING: u8 = 4;

/// A running relay holds the store (exit code [`EXIT_RELAY_RUNNING`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RelayRunning(pub String);

/// Where an operator command runs.
#[derive(Debug, Args)]
pub struct Target {
    /// Run offline on this relay store directory (refused while `relay serve` runs on it)
    #[arg(long, value_name = "DIR", env = "MBX_RELAY_DIR")]
    pub store_dir: Option<PathBuf>,
    /// Run through the running relay at this URL (its admin endpoint; needs the admin token
    /// from --admin-token-file or MBX_RELAY_ADMIN_TOKEN). Wins over --store-dir. Plain http://
    /// only to this machine (loopback) unless --insecure-http
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// File holding the relay's admin token (with --url; wins over MBX_RELAY_ADMIN_TOKEN)
    #[arg(long, value_name = "FILE", requires = "url")]
    pub admin_token_file: Option<PathBuf>,
    /// Send the admin token over plain http:// to a host that is not this machine (only on a
    /// network path you trust: anyone on it can read the token)
    #[arg(long, requires = "url")]
    pub insecure_http: bool,
    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `relay revoke`.
#[derive(Debug, Args)]
#[command(
    after_long_help = concat!("Exit status: 0 revoked (or already revoked), 1 failure or an \
ambiguous fingerprint, 2 usage error, 3 no such enrolment or store, 4 a relay runs on the \
store (use --url).", token_help!())
)]
pub struct RevokeArgs {
    /// The host: its key (base64) or fingerprint (16 hex digits, dashes optional)
    #[arg(value_name = "HOST")]
    pub host: String,
    #[command(flatten)]
    pub target: Target,
}

/// Flags of `relay deny`.
#[derive(Debug, Args)]
#[command(
    after_long_help = concat!("A host fingerprint (or host key) denies that host; anything else \
is a token client_id (--client forces that reading). Exit status: 0 done, 1 failure, 2 usage \
error, 3 nothing to remove or no store, 4 a relay runs on the store (use --url).", token_help!())
)]
pub struct DenyArgs {
    /// Host fingerprint (or host key) or token client_id to deny (or, with --remove, to allow
    /// again)
    #[arg(value_name = "HOST_FP|CLIENT_ID", required_unless_present = "list")]
    pub subject: Option<String>,
    /// Read the argument as a token client_id even if it looks like a fingerprint
    #[arg(long)]
    pub client: bool,
    /// Deny until this time: a duration (90s, 30m, 2h, 7d, 1w) or a UTC time
    /// (2026-01-31T12:00:00Z); at least 15 min (the longest token lifetime). Default: until
    /// removed
    #[arg(long, value_name = "WHEN", conflicts_with_all = ["remove", "list"])]
    pub until: Option<String>,
    /// Remove the entry instead
    #[arg(long, conflicts_with = "list")]
    pub remove: bool,
    /// List the deny-list
    #[arg(long, conflicts_with = "subject")]
    pub list: bool,
    #[command(flatten)]
    pub target: Target,
}

/// The clock of these commands: the system clock, shifted by `MBX_CLOCK_OFFSET_MS` like every
/// other process (drills and tests).
pub(super) fn now_ms() -> anyhow::Result<i64> {
    use agentmbx_protocol::clock::Clock as _;
    Ok(agentmbx_protocol::clock::SystemClock::from_env()?.now_ms())
}

/// Where the command runs, once checked.
pub(super) enum Place {
    Offline(PathBuf),
    Online(Online),
}

/// A running relay's admin endpoint and the token for it.
pub(super) struct Online {
    url: String,
    token: AdminToken,
    /// Where the token came from, for messages (`--admin-token-file <path>` or the variable's
    /// name; never the token).
    source: String,
}

impl Online {
    /// The relay URL.
    pub(super) fn url(&self) -> &str {
        &self.url
    }
}

/// The admin endpoint of the relay serving the store in `dir` on this machine, for a command
/// that was given no `--url`: the admin token configured for that relay here
/// ([`ADMIN_TOKEN_ENV`], else `admin_token_file` in the store's `relay.toml`) and
/// `http://127.0.0.1:<port>` (`[::1]` for a relay bound to an IPv6 address) with the port the
/// relay's own start reads: `PORT`, else `port` in `relay.toml`, else 7374. `Err` says why
/// there is none (no token configured, `relay.toml` unreadable, a relay bound to another
/// address than loopback or all addresses, port 0); it never holds the token.
pub(super) fn local_admin_endpoint(dir: &std::path::Path) -> Result<Online, String> {
    use std::net::IpAddr;
    let config = agentmbx_relay::config::RelayConfig::load(dir)
        .map_err(|e| format!("the relay's configuration cannot be read ({e})"))?;
    let Some(token) = config.admin_token.clone() else {
        return Err(format!(
            "no admin token is configured here ({ADMIN_TOKEN_ENV}, or admin_token_file in {})",
            dir.join("relay.toml").display()
        ));
    };
    // `load` applied `PORT` over relay.toml's `port`, as `relay serve` does.
    let port = config.port.unwrap_or(agentmbx_relay::config::DEFAULT_PORT);
    if port == 0 {
        return Err("the relay's port is not known here (port 0 picks a free one)".into());
    }
    let host = match config.bind {
        None => "127.0.0.1",
        Some(IpAddr::V4(a)) if a.is_unspecified() || a.is_loopback() => "127.0.0.1",
        Some(IpAddr::V6(a)) if a.is_unspecified() || a.is_loopback() => "[::1]",
        Some(other) => {
            return Err(format!(
                "the relay binds {other}, not this machine's loopback address"
            ))
        }
    };
    Ok(Online {
        url: format!("http://{host}:{port}"),
        token,
        source: format!(
            "the admin token configured for the relay ({ADMIN_TOKEN_ENV} or relay.toml's admin_token_file)"
        ),
    })
}

/// True when `url` (checked by [`agentmbx::config::check_relay_url`]) names this machine:
/// `localhost`, an IPv4 address in 127.0.0.0/8 or `::1`.
fn is_loopback(url: &str) -> bool {
    let Some(parsed) = reqwest::Url::parse(url).ok() else {
        return false;
    };
    let host = parsed.host_str().unwrap_or("");
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses to send the admin token over plain `http://` to a host that is not this machine
/// unless `insecure` (`--insecure-http`). Errors: [`UsageError`] saying so (nothing was sent).
fn plain_http_allowed(url: &str, insecure: bool) -> Result<(), UsageError> {
    if url.starts_with("http://") && !is_loopback(url) && !insecure {
        return Err(UsageError(format!(
            "--url {url}: plain http:// to a host that is not this machine would send the admin token unencrypted; use https://, or --insecure-http if you trust the network path"
        )));
    }
    Ok(())
}

/// The admin token and its source: `--admin-token-file` wins over [`ADMIN_TOKEN_ENV`].
/// Errors: neither given or unreadable (usage, or the file's read error), malformed (usage);
/// they name the source, never the token.
fn admin_token(file: Option<&std::path::Path>) -> anyhow::Result<(AdminToken, String)> {
    if let Some(file) = file {
        let source = format!("--admin-token-file {}", file.display());
        let text =
            std::fs::read_to_string(file).with_context(|| format!("cannot read {source}"))?;
        let token = AdminToken::new(&text).map_err(|e| UsageError(format!("{source}: {e}")))?;
        return Ok((token, source));
    }
    match std::env::var(ADMIN_TOKEN_ENV) {
        Ok(text) => {
            let token = AdminToken::new(&text)
                .map_err(|e| UsageError(format!("{ADMIN_TOKEN_ENV}: {e}")))?;
            Ok((token, ADMIN_TOKEN_ENV.to_string()))
        }
        Err(std::env::VarError::NotUnicode(_)) => Err(UsageError(format!(
            "{ADMIN_TOKEN_ENV}: the admin token must be printable ASCII without spaces"
        ))
        .into()),
        Err(std::env::VarError::NotPresent) => Err(UsageError(format!(
            "--url needs the relay's admin token: give --admin-token-file or set {ADMIN_TOKEN_ENV}"
        ))
        .into()),
    }
}

pub(super) fn place(t: &Target) -> anyhow::Result<Place> {
    match (&t.store_dir, &t.url) {
        (Some(dir), None) => Ok(Place::Offline(dir.clone())),
        (_, Some(url)) => {
            // The admin token goes to this URL: the same checks as `relay set`.
            let url = agentmbx::config::check_relay_url(url)
                .map_err(|e| UsageError(format!("--url: {e}")))?;
            plain_http_allowed(&url, t.insecure_http)?;
            let (token, source) = admin_token(t.admin_token_file.as_deref())?;
            Ok(Place::Online(Online { url, token, source }))
        }
        _ => Err(UsageError(
            "give --store-dir <dir> (offline) or --url <relay url> (a running relay)".into(),
        )
        .into()),
    }
}

/// Maps a refusal of the relay crate to the CLI's error kinds (exit codes, module docs).
pub(super) fn refusal(e: AdminError) -> anyhow::Error {
    match e {
        AdminError::Invalid(m) => UsageError(m).into(),
        e @ (AdminError::NotFound(_) | AdminError::NoStore(_)) => {
            NotFoundError(e.to_string()).into()
        }
        e @ AdminError::Running(_) => RelayRunning(e.to_string()).into(),
        e => anyhow::Error::new(e),
    }
}

/// Runs `f` on the store opened offline, then closes it. When the relay key is not available
/// (neither `MBX_RELAY_KEY` nor `relay.key`), the change is still made and its relay-log
/// receipt is unsigned: one warning on stderr says so and why, once `f` succeeded.
pub(super) fn offline<T>(
    dir: &std::path::Path,
    f: impl FnOnce(&dyn agentmbx_relay::store::RelayStore, i64) -> Result<T, AdminError>,
) -> anyhow::Result<T> {
    let now = now_ms()?;
    let opened = admin::open_offline(dir, now).map_err(refusal)?;
    let out = f(&opened.store, now).map_err(refusal);
    opened.store.close().context("closing the relay store")?;
    if out.is_ok() {
        warn_unsigned(opened.unsigned.as_deref());
    }
    out
}

/// The one warning of an offline command whose relay-log receipt is unsigned
/// ([`agentmbx_relay::ops::unsigned_receipt_reason`]); nothing when it is signed.
pub(super) fn warn_unsigned(reason: Option<&str>) {
    if let Some(reason) = reason {
        eprintln!("warning: {reason}");
    }
}

/// One admin request; a refusal becomes the matching CLI error.
pub(super) fn online(
    target: &Online,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let Online { url, token, source } = target;
    agentmbx::install_tls_provider();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (status, answer) = runtime.block_on(async {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .context("cannot build the HTTP client")?;
        let mut req = match method {
            "GET" => http.get(format!("{url}{path}")),
            _ => http
                .post(format!("{url}{path}"))
                .json(&body.unwrap_or(Value::Null)),
        };
        req = req.bearer_auth(token.expose());
        let resp = req.send().await.map_err(|e| {
            anyhow::anyhow!(
                "cannot reach the relay at {url}: {}",
                agentmbx::transport::relay_client::describe(&e)
            )
        })?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(|e| {
            anyhow::anyhow!(
                "the relay's answer broke off: {}",
                agentmbx::net_error::describe(&e, None)
            )
        })?;
        anyhow::Ok((
            status,
            serde_json::from_slice::<Value>(&bytes).unwrap_or(Value::Null),
        ))
    })?;
    if status == 200 {
        return Ok(answer);
    }
    // The relay's words, never its control or format characters.
    let error = clean(
        answer
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("no error text"),
    );
    let code = answer.get("code").and_then(Value::as_str).unwrap_or("");
    Err(match (status, code) {
        (404, "NOT_FOUND") if path.contains("admin") && error == "not found" => anyhow::anyhow!(
            "the relay at {url} has no admin endpoint (it runs without an admin token)"
        ),
        (401, _) => anyhow::anyhow!("the relay at {url} refused the admin token from {source}"),
        (400, _) => UsageError(error).into(),
        (404, _) => NotFoundError(error).into(),
        _ => anyhow::anyhow!("the relay at {url} answered {status}: {error}"),
    })
}

/// A relay's error text as it may be printed: at most 300 characters, control and bidi or
/// other format characters escaped (`\u{…}`).
fn clean(text: &str) -> String {
    let format = |c: char| {
        matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}'
            | '\u{061c}' | '\u{feff}')
    };
    let mut out = String::new();
    for c in text.chars().take(300) {
        if c.is_control() || format(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

pub(super) fn print(json_out: bool, value: &Value, text: &str) -> anyhow::Result<()> {
    if json_out {
        println!("{}", serde_json::to_string_pretty(value)?);
    } else {
        println!("{text}");
    }
    Ok(())
}

/// `relay revoke <HOST>`.
pub fn revoke(args: RevokeArgs) -> anyhow::Result<()> {
    // Checked here too, so a malformed argument never reaches a relay (exit 2).
    admin::revoke_target(&args.host).map_err(refusal)?;
    let report: Value = match place(&args.target)? {
        Place::Offline(dir) => {
            let r: RevokeReport =
                offline(&dir, |store, now| admin::revoke(store, &args.host, now))?;
            json!({"ok": true, "newly_revoked": r.newly_revoked, "host": r.host})
        }
        Place::Online(target) => online(
            &target,
            "POST",
            "/v2/relay/admin/revoke",
            Some(json!({"host": args.host})),
        )?,
    };
    let host = &report["host"];
    let text = format!(
        "{} {} ({}){}",
        if report["newly_revoked"] == true {
            "revoked"
        } else {
            "already revoked:"
        },
        host["fingerprint"].as_str().unwrap_or(""),
        host["host_name"].as_str().unwrap_or(""),
        if report["newly_revoked"] == true {
            ": its next request is refused, and it can never enrol again on this relay"
        } else {
            ""
        }
    );
    print(args.target.json, &report, &text)
}

/// `relay deny [<HOST_FP|CLIENT_ID>] [--until WHEN] [--remove] [--list]`.
pub fn deny(args: DenyArgs) -> anyhow::Result<()> {
    let place = place(&args.target)?;
    let kind = args.client.then_some(DenyKind::Client);
    if args.list {
        let entries: Value = match place {
            Place::Offline(dir) => json!(offline(&dir, |store, now| admin::deny_list(store, now))?),
            Place::Online(target) => {
                online(&target, "GET", "/v2/relay/admin/deny", None)?["entries"].take()
            }
        };
        let mut text = String::new();
        for e in entries.as_array().map(Vec::as_slice).unwrap_or_default() {
            text.push_str(&format!(
                "{} {}  until {}{}\n",
                e["kind"].as_str().unwrap_or(""),
                e["value"].as_str().unwrap_or(""),
                e["until"].as_str().unwrap_or("removed"),
                if e["active"] == true {
                    ""
                } else {
                    "  (expired)"
                }
            ));
        }
        if text.is_empty() {
            text.push_str("the deny-list is empty\n");
        }
        return print(
            args.target.json,
            &json!({ "entries": entries }),
            text.trim_end(),
        );
    }
    let subject = args
        .subject
        .ok_or_else(|| UsageError("give a host fingerprint or client_id, or --list".into()))?;
    // Checked here too, so a malformed argument never reaches a relay (exit 2).
    admin::deny_target(&subject, kind).map_err(refusal)?;
    if args.remove {
        let out: Value = match place {
            Place::Offline(dir) => {
                let (k, value, removed) =
                    offline(&dir, |store, now| admin::undeny(store, &subject, kind, now))?;
                json!({"ok": true, "removed": removed, "kind": k.as_str(), "value": value})
            }
            Place::Online(target) => online(
                &target,
                "POST",
                "/v2/relay/admin/undeny",
                Some(json!({"target": subject, "kind": kind.map(DenyKind::as_str)})),
            )?,
        };
        if out["removed"] != true {
            return Err(NotFoundError(format!(
                "no deny-list entry for {} {}",
                out["kind"].as_str().unwrap_or(""),
                out["value"].as_str().unwrap_or("")
            ))
            .into());
        }
        let text = format!(
            "removed {} {} from the deny-list",
            out["kind"].as_str().unwrap_or(""),
            out["value"].as_str().unwrap_or("")
        );
        return print(args.target.json, &out, &text);
    }
    let now = now_ms()?;
    let until = args
        .until
        .as_deref()
        .map(|u| admin::parse_until(u, now).map_err(refusal))
        .transpose()?;
    let entry: Value = match place {
        Place::Offline(dir) => {
            let e = offline(&dir, |store, now| {
                admin::deny(store, &subject, kind, until, now)
            })?;
            json!(DenyView::of(&e, now))
        }
        Place::Online(target) => online(
            &target,
            "POST",
            "/v2/relay/admin/deny",
            Some(json!({"target": subject, "kind": kind.map(DenyKind::as_str), "until_ms": until})),
        )?["entry"]
            .take(),
    };
    let text = format!(
        "denied {} {} until {}: its next request is refused",
        entry["kind"].as_str().unwrap_or(""),
        entry["value"].as_str().unwrap_or(""),
        entry["until"].as_str().unwrap_or("removed")
    );
    print(
        args.target.json,
        &json!({"ok": true, "entry": entry}),
        &text,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_carries_the_admin_token_only_to_this_machine_unless_insecure() {
        for ok in [
            "http://127.0.0.1:7374",
            "http://127.8.9.10",
            "http://localhost:7374",
            "http://LOCALHOST",
            "http://[::1]:7374",
            "https://relay.example.org",
            "https://192.0.2.1:443",
        ] {
            assert!(plain_http_allowed(ok, false).is_ok(), "{ok}");
        }
        for far in [
            "http://relay.example.org",
            "http://192.0.2.1:7374",
            "http://[2001:db8::1]:7374",
            "http://localhost.example.org",
            "http://128.0.0.1",
        ] {
            let e = plain_http_allowed(far, false).unwrap_err();
            assert!(e.0.contains("--insecure-http"), "{far}: {e}");
            assert!(plain_http_allowed(far, true).is_ok(), "{far}");
        }
    }
}
