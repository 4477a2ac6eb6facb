//! The `agentmbx` binary: the CLI, the host daemon (`agentmbx daemon`) and the relay
//! (`agentmbx relay serve`) in one executable (design README "Decisions already taken").
//!
//! `main` only restores the default SIGPIPE action of one-shot commands, installs the TLS crypto
//! provider and the logger and hands over to [`cli`]; everything else lives in the library
//! (`agentmbx::…`) so the black-box tests exercise the same code.
//!
//! Its modules: [`cli`] (the commands), [`mcp`] (`agentmbx mcp`, the MCP server) and, below both,
//! [`local_api`] (the client of the daemon's local API they share).

mod cli;
mod local_api;
mod mcp;

use std::io::IsTerminal;
use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

/// Environment variable holding the log filter (tracing `EnvFilter` syntax; default `info` for
/// servers, `error` for one-shot commands).
const LOG_ENV: &str = "MBX_LOG";

fn main() -> ExitCode {
    if !long_running(std::env::args_os().skip(1)) {
        restore_sigpipe();
    }
    agentmbx::install_tls_provider();
    cli::main(init_logging)
}

/// Whether the arguments start a long-running server (`daemon`, `mcp`, `relay serve`). Those keep
/// SIGPIPE ignored: their stderr may be a log socket (journald) that goes away and comes back,
/// and a closed log stream must not end a server.
fn long_running(mut args: impl Iterator<Item = std::ffi::OsString>) -> bool {
    match args.next() {
        Some(first) if first == "daemon" || first == "mcp" => true,
        Some(first) if first == "relay" => args.next().is_some_and(|a| a == "serve"),
        _ => false,
    }
}

/// Gives SIGPIPE back its default action (end the process quietly) for one-shot commands, as
/// every Unix tool has it. The Rust runtime ignores SIGPIPE, so a write to a closed pipe
/// (`agentmbx relay info | head -1`) would fail with EPIPE and `println!` would panic.
#[cfg(unix)]
#[allow(unsafe_code)]
fn restore_sigpipe() {
    // SAFETY: called first thing in `main`, before any other thread exists; `signal` with
    // SIG_DFL installs no handler code, it only sets the disposition of SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn restore_sigpipe() {}

/// Logs go to stderr (stdout is for command output), filtered by `MBX_LOG`. A filter that does
/// not parse falls back to `default_level` with a warning rather than silencing the daemon.
fn init_logging(default_level: &'static str) {
    let requested = std::env::var(LOG_ENV).ok().filter(|v| !v.trim().is_empty());
    let (filter, bad) = match requested.as_deref().map(EnvFilter::try_new) {
        None => (EnvFilter::new(default_level), None),
        Some(Ok(filter)) => (filter, None),
        Some(Err(e)) => (EnvFilter::new(default_level), Some(e)),
    };
    // The filter sits in a reload layer so the daemon can apply `log_level` from config.toml
    // without a restart (agentmbx::config_watch).
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal()),
        )
        .init();
    agentmbx::config_watch::set_log_filter_hook(Box::new(move |text| {
        let filter = EnvFilter::try_new(text).map_err(|e| e.to_string())?;
        handle.reload(filter).map_err(|e| e.to_string())
    }));
    if let Some(e) = bad {
        tracing::warn!("{LOG_ENV} is not a valid log filter ({e}); logging at {default_level}");
    }
}
