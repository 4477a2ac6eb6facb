//! `agentmbx pair`, `agentmbx join`: pairing two hosts on the LAN (`wire.md` §2.9, §5
//! "Machines").
//!
//! - `pair [--ttl 10m] [--json]`: a one-time token for `agentmbx join` on the other host (this
//!   host's daemon must be running to accept the join);
//! - `join <host[:port]> <TOKEN> [--json]`: proves the token to the host that printed it and
//!   pins it;
//! - `pair --compare <host[:port]> [--json]`: a 6-digit code both humans compare;
//! - `pair approve <host> <code>`: pins a compared host once the codes matched;
//! - `pair pending [--json]`: comparisons waiting for approval, with their codes.
//!
//! The work is done by `agentmbx::pairing::client`; this file parses, loads the host and
//! prints. The token is printed once, here, and nowhere else.

use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Subcommand};

use agentmbx::config::Config;
use agentmbx::identity;
use agentmbx::mailbox::Mailbox;
use agentmbx::pairing::client::{self, Local, PairError};
use agentmbx::pairing::store;
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{SharedClock, SystemClock};
use agentmbx_protocol::time::iso_ms;

use super::{NotFoundError, UsageError};

/// Flags of `pair`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PairArgs {
    /// Approve or list code comparisons
    #[command(subcommand)]
    pub command: Option<PairCommand>,
    /// How long the token can be used: e.g. 90s, 10m, 1h (1 h at most)
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "10m",
        conflicts_with = "compare"
    )]
    pub ttl: String,
    /// Pair with the host at HOST[:PORT] by comparing a 6-digit code instead of a token
    #[arg(long, value_name = "HOST:PORT")]
    pub compare: Option<String>,
    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

/// Subcommands of `pair`.
#[derive(Debug, Subcommand)]
pub enum PairCommand {
    /// Pin a host compared with `pair --compare` once both hosts show the same code
    Approve {
        /// The other host's name
        host: String,
        /// The 6-digit code the other host shows
        code: String,
        /// Print the result as JSON
        #[arg(long)]
        json: bool,
    },
    /// List code comparisons waiting for approval, with the code this host computed
    Pending {
        /// Print the list as JSON
        #[arg(long)]
        json: bool,
    },
}

/// Flags of `join`.
#[derive(Debug, Args)]
pub struct JoinArgs {
    /// The address of the host that printed the token: host or host:port (port 7373 when
    /// omitted)
    #[arg(value_name = "HOST[:PORT]")]
    pub addr: String,
    /// The token its `agentmbx pair` printed (XXXX-XXXX-XXXX)
    #[arg(value_name = "TOKEN")]
    pub token: String,
    /// Print the result as JSON: {host, host_pubkey, fingerprint, addr, new}
    #[arg(long)]
    pub json: bool,
}

/// This host, loaded for pairing: it must be initialized.
struct Host {
    local: Local,
}

fn load() -> anyhow::Result<Host> {
    let paths = Paths::from_env()?;
    let config = Config::load(&paths)?;
    let ident = identity::load(&paths, &config)?;
    paths.ensure_home()?;
    let mailbox = Mailbox::open(&paths.mailbox_db()).context("cannot open mailbox.db")?;
    let clock: SharedClock = Arc::new(SystemClock::from_env()?);
    let advertise = agentmbx::transport::lan::pairing_addr(&paths, &config);
    Ok(Host {
        local: Local {
            ident: Arc::new(ident),
            mailbox,
            clock,
            advertise,
        },
    })
}

/// A pairing error with the exit code it deserves (2 usage, 3 not found, else 1).
fn cli_error(e: PairError) -> anyhow::Error {
    if e.is_usage() {
        UsageError(e.to_string()).into()
    } else if e.is_not_found() {
        NotFoundError(e.to_string()).into()
    } else {
        e.into()
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// `10 min`, `90 s`, `1 h`, `1 h 30 min`.
fn human_ms(ms: i64) -> String {
    let secs = ms / 1000;
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    let mut parts = Vec::new();
    if h > 0 {
        parts.push(format!("{h} h"));
    }
    if m > 0 {
        parts.push(format!("{m} min"));
    }
    if s > 0 || parts.is_empty() {
        parts.push(format!("{s} s"));
    }
    parts.join(" ")
}

/// Runs `pair`.
pub fn run(args: PairArgs) -> anyhow::Result<()> {
    match args.command {
        Some(PairCommand::Approve { host, code, json }) => approve(&host, &code, json),
        Some(PairCommand::Pending { json }) => pending(json),
        None => match args.compare {
            Some(addr) => compare(&addr, args.json),
            None => token(&args.ttl, args.json),
        },
    }
}

fn token(ttl: &str, json: bool) -> anyhow::Result<()> {
    let ttl_ms = client::parse_ttl(ttl).map_err(cli_error)?;
    let host = load()?;
    let now = host.local.clock.now_ms();
    let made = host
        .local
        .mailbox
        .with(|c| Ok(client::create_token(c, ttl_ms, now)))?
        .map_err(cli_error)?;
    let join = format!("agentmbx join {} {}", host.local.advertise, made.token);
    if json {
        let out = serde_json::json!({
            "token": made.token,
            "id": made.id,
            "expires_at": iso_ms(made.expires_at),
            "ttl_ms": ttl_ms,
            "addr": host.local.advertise,
            "join": join,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "pairing token: {} (single use, valid {}, until {})",
        made.token,
        human_ms(ttl_ms),
        iso_ms(made.expires_at)
    );
    println!("on the other host run: {join}");
    println!(
        "the daemon on this host must be running to accept the join (agentmbx daemon); if {} is not how the other host reaches this one, use this host's LAN address instead",
        host.local.advertise
    );
    Ok(())
}

/// Runs `join`.
pub fn join(args: JoinArgs) -> anyhow::Result<()> {
    // Refuse a malformed address or token before loading anything.
    client::normalize_addr(&args.addr).map_err(cli_error)?;
    agentmbx_protocol::pairing::normalize_token(&args.token)
        .map_err(|e| cli_error(PairError::Token(e)))?;
    let host = load()?;
    let paired = runtime()?
        .block_on(client::join(&host.local, &args.addr, &args.token))
        .map_err(cli_error)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&paired)?);
    } else {
        println!(
            "paired with {} (fingerprint {}) at {}{}",
            paired.host,
            paired.fingerprint,
            paired.addr,
            if paired.new {
                ""
            } else {
                " (already pinned to this key; address updated)"
            }
        );
    }
    Ok(())
}

fn compare(addr: &str, json: bool) -> anyhow::Result<()> {
    client::normalize_addr(addr).map_err(cli_error)?;
    let host = load()?;
    let compared = runtime()?
        .block_on(client::compare(&host.local, addr))
        .map_err(cli_error)?;
    if json {
        let mut out = serde_json::to_value(&compared)?;
        out["expires_at"] = serde_json::Value::String(iso_ms(compared.expires_at));
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let own = host.local.ident.host.to_string();
    println!(
        "comparing with {} (fingerprint {}) at {}",
        compared.host, compared.fingerprint, compared.addr
    );
    println!("code: {}", compared.code);
    println!(
        "check that {} shows the same code (its daemon log, or `agentmbx pair pending` there), then approve on both hosts:",
        compared.host
    );
    println!(
        "  here:    agentmbx pair approve {} <code {} shows>",
        compared.host, compared.host
    );
    println!(
        "  on {}: agentmbx pair approve {own} {}",
        compared.host, compared.code
    );
    println!(
        "if the codes differ, approve nothing: something is in the middle. The comparison expires at {}",
        iso_ms(compared.expires_at)
    );
    Ok(())
}

fn approve(peer: &str, code: &str, json: bool) -> anyhow::Result<()> {
    let host = load()?;
    let now = host.local.clock.now_ms();
    let own = host.local.ident.host.to_string();
    let paired = host
        .local
        .mailbox
        .with(|c| Ok(client::approve(c, &own, peer, code, now)))?
        .map_err(cli_error)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&paired)?);
    } else {
        println!(
            "paired with {} (fingerprint {}) at {}",
            paired.host, paired.fingerprint, paired.addr
        );
    }
    Ok(())
}

fn pending(json: bool) -> anyhow::Result<()> {
    let host = load()?;
    let now = host.local.clock.now_ms();
    let rows = host.local.mailbox.with(|c| store::list_pending(c, now))?;
    if json {
        let out: Vec<serde_json::Value> = rows
            .iter()
            .map(|p| {
                serde_json::json!({
                    "host": p.host,
                    "host_pubkey": p.pubkey,
                    "fingerprint": agentmbx_protocol::keys::PublicKey::from_b64(&p.pubkey)
                        .map(|k| k.fingerprint()).unwrap_or_default(),
                    "addr": p.addr,
                    "code": p.code,
                    "expires_at": iso_ms(p.expires_at),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no comparisons waiting (start one with `agentmbx pair --compare <host:port>`)");
    }
    for p in rows {
        let fp = agentmbx_protocol::keys::PublicKey::from_b64(&p.pubkey)
            .map(|k| k.fingerprint())
            .unwrap_or_default();
        println!(
            "{}  code {}  fingerprint {}  at {}  expires {}",
            p.host,
            p.code,
            fp,
            p.addr.as_deref().unwrap_or("-"),
            iso_ms(p.expires_at)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn durations_read_well() {
        assert_eq!(human_ms(600_000), "10 min");
        assert_eq!(human_ms(90_000), "1 min 30 s");
        assert_eq!(human_ms(3_600_000), "1 h");
        assert_eq!(human_ms(45_000), "45 s");
    }

    #[test]
    fn bad_input_is_a_usage_error() {
        let e = cli_error(client::parse_ttl("2h").unwrap_err());
        assert_eq!(super::super::exit_code(&e), super::super::EXIT_USAGE);
        let e = cli_error(PairError::NoPending("bob".into()));
        assert_eq!(super::super::exit_code(&e), super::super::EXIT_NOT_FOUND);
    }
}
