//! The command line: argument definitions (clap derive), dispatch, and the process edge —
//! exit codes and the error line (`wire.md` §5).
//!
//! One file per command group, each thin: parse flags, call the library (`agentmbx::…`), print.
//! Exit codes: 0 success, 1 other failure, 2 usage, 3 not found, 4 a relay runs on the store
//! (offline relay operator commands, and a `relay serve` that gave up waiting for
//! `relay.lock`), 75 temporary failure (EX_TEMPFAIL: the daemon did not confirm a change in
//! time, so its outcome is unknown, or its store stayed busy; `read`, a GET that marks read,
//! too). Errors go to stderr as one line
//! `agentmbx: <msg>`, usage errors followed by `(see: agentmbx <cmd> --help)`.
//!
//! This is the only place (with `main.rs`) that uses `anyhow`, prints to stdout, or decides the
//! process's exit code. It must never put secrets in output or errors.

pub mod completions;
pub mod config;
pub mod daemon;
pub mod daemon_service;
pub mod discover;
pub mod doctor;
pub mod hooks;
pub mod host;
pub mod init;
pub mod mail;
pub mod man;
pub mod mcp;
pub mod pair;
pub mod peers;
pub mod relay;
pub mod relay_admin;
pub mod relay_info;
pub mod relay_ops;
pub mod relay_status;
pub mod setup;
pub mod wake;
pub mod watch;
pub mod whoami;

use std::process::ExitCode;

use agentmbx::host_name::HostNameError;
use agentmbx::identity::IdentityError;
use clap::{CommandFactory, Parser, Subcommand};

/// Exit code for a failure that is not one of the others.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for bad arguments.
pub const EXIT_USAGE: u8 = 2;
/// Exit code when the thing asked for does not exist (e.g. the host is not initialized).
pub const EXIT_NOT_FOUND: u8 = 3;
/// Exit code for a temporary failure (EX_TEMPFAIL, sysexits.h): the daemon did not confirm a
/// change within the retry budget (the outcome is unknown; the message says how to check and
/// prints the Idempotency-Key to rerun with), or its store stayed busy.
pub const EXIT_TEMPFAIL: u8 = 75;

/// Shown after `agentmbx --help` and in `agentmbx(1)`: the environment and the exit codes.
const ENVIRONMENT_HELP: &str = "\
Environment (each overrides the matching config.toml setting):
  MBX_HOME: home directory (default: the platform data directory)
  MBX_API_PORT, MBX_API_BIND: local API port and address (api_port, api_bind)
  MBX_LAN_PORT, MBX_LAN_BIND: LAN server port and address (lan_port, lan_bind)
  MBX_ADVERTISE: host:port given to peers at pairing (advertise)
  MBX_SELF_ADDRS: comma-separated own LAN IPs for status and presence (self_addrs)
  MBX_NO_MDNS=1: no mDNS advertising or browsing (mdns = false)
  MBX_RELAY_URL: relay base URL ([relay] url)
  MBX_RELAY_PULL_INTERVAL_MS: pause between relay pulls in ms (relay_pull_interval_ms)
  MBX_RELAY_STREAM=0: no relay push stream, poll instead (relay_stream = false)
  HTTPS_PROXY, HTTP_PROXY, ALL_PROXY, NO_PROXY: the proxy for relay calls (never used for
    LAN peers or the local API)
  MBX_KEYSTORE: keyring|file, where init keeps the private keys (key_store; default: the OS
    keyring when it answers, else 0600 files); an initialised home never switches
  MBX_LOG: log filter (default: log_level for the daemon, else info for daemon and relay,
    error otherwise: one-shot commands print their own findings)
  MBX_CLOCK_OFFSET_MS, MBX_FAILPOINTS: for tests and drills only
  MBX_CLI_RETRY_MS: how long send, ack, read, inbox and sent keep retrying a call the daemon
    did not settle (default 60000; for tests only)
  MBX_AGENT: the agent `agentmbx mcp` acts as (its --as)
  MBX_MCP_PROGRESS_MS: how often mbx_wait sends a progress notification (default 10000; for
    tests only)

Exit status: 0 success, 1 failure, 2 usage error, 3 not found (e.g. host not initialized),
4 a relay runs on the store (offline relay operator commands; relay serve when another
relay still holds relay.lock after lock_wait_ms), 75 temporary failure (EX_TEMPFAIL): send or
ack got no answer that settles it within 60 s of retries with one Idempotency-Key, so the
outcome is unknown (the message prints the key and how to check; rerunning with
--idempotency-key <key> cannot do it twice), read likewise (it marks the message read; the
message says how to check; reading again is safe), the daemon's store stayed busy or the agent
stayed rate-limited (nothing done), or its idempotency records are full (IDEMPOTENCY_FULL).";

/// Shown after `send --help`, `reply --help` and `ack --help` and in their man pages: retries
/// and exit 75; `$usage` is the command's own example of a usage error (exit 2).
macro_rules! mutation_help {
    ($usage:literal) => {
        concat!(
            "The call carries one Idempotency-Key (--idempotency-key, else a fresh one) and is \
retried with
it for 60 s while the daemon does not settle it (no answer, a broken connection, a 5xx, a busy
store; a rate limit, 429, is waited out for its retry_after); the daemon answers a repeated key
with its first answer, so it is never done twice.
Exit status: 0 done, 1 failure (nothing done), 2 usage error (e.g. ",
            $usage,
            "),
3 not found, 75 (EX_TEMPFAIL) still unsettled after 60 s: the message says whether the outcome
is unknown, how to check it (agentmbx sent / inbox) and prints the key; rerun the same command
with --idempotency-key <key> to finish it without doing it twice."
        )
    };
}

/// AgentMBX: a signed, end-to-end-sealed mailbox for AI agents.
#[derive(Debug, Parser)]
#[command(
    name = "agentmbx",
    version,
    about = "Signed, end-to-end-sealed mailbox for AI agents",
    long_about = "Signed, end-to-end-sealed mailbox for AI agents.\n\n\
        Agents on this machine send mail through the local daemon (`agentmbx daemon`), which \
        signs every envelope with this host's key and seals every body for the receiving host. \
        Files live in MBX_HOME (default: the platform data directory).",
    after_long_help = ENVIRONMENT_HELP,
    propagate_version = true
)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create this host's identity (name, host key, enc key) in MBX_HOME
    Init(init::InitArgs),
    /// Print this host's name, public key and fingerprint
    Whoami(whoami::WhoamiArgs),
    /// Run the host daemon in the foreground (initializes a fresh host first)
    Daemon(daemon::DaemonArgs),
    /// Run a relay, or operate one
    #[command(subcommand)]
    Relay(relay::RelayCommand),
    /// Check config.toml: `config validate`
    #[command(subcommand)]
    Config(config::ConfigCommand),
    /// List peer hosts; pin one by key, set its LAN address, or unpair it
    Peers(peers::PeersArgs),
    /// Pair with another host on the LAN: print a one-time token for `agentmbx join`, or
    /// compare a 6-digit code (--compare, then `pair approve`)
    Pair(pair::PairArgs),
    /// Pair with the host that printed a token (`agentmbx pair` there)
    Join(pair::JoinArgs),
    /// Manage this host's keys: `host rotate`
    #[command(subcommand)]
    Host(host::HostCommand),
    /// List the AgentMBX hosts that answer on the LAN (mDNS, 3 s) and whether they are paired
    Discover(discover::DiscoverArgs),
    /// Send a message from an agent on this host (through the running daemon)
    #[command(after_help = mutation_help!("a malformed --to address"))]
    Send(mail::SendArgs),
    /// List an agent's messages (--wait: wait for mail to arrive; --unclaimed: the mail held for names with no agent here)
    Inbox(mail::InboxArgs),
    /// Print each new message for an agent as it arrives (ids, sender, kind; never the body),
    /// until interrupted; --cursor-file resumes across restarts
    #[command(
        after_help = "Reads the daemon's event stream (GET /v1/events). Each line names a \
        message; read it with `agentmbx read <id> --as <agent>`. With --json each line is \
        {cursor, id, from, thread, kind, needs_reply}. When the daemon stops or restarts, the \
        watch reconnects from the last message it printed. Exit codes: 2 a bad name or cursor, \
        3 no such agent here, 1 a cursor file that cannot be read or written."
    )]
    Watch(watch::WatchArgs),
    /// Show one message (marks it read for the agent)
    Read(mail::ReadArgs),
    /// Answer a message: to its sender, in its thread, subject `Re: …`, kind reply
    #[command(after_help = mutation_help!("an --idempotency-key with a space"))]
    Reply(mail::ReplyArgs),
    /// Show the messages of a thread the agent can see, oldest first (bounded pages)
    Thread(mail::ThreadArgs),
    /// Search an agent's mail (subjects and bodies) for words, best first
    Search(mail::SearchArgs),
    /// Acknowledge messages in an agent's mailbox
    #[command(after_help = mutation_help!("a note over 500 UTF-16 code units"))]
    Ack(mail::AckArgs),
    /// List an agent's sent messages with each recipient's delivery state
    Sent(mail::SentArgs),
    /// Mute or unmute an agent's wakes (Claude Code channel notifications): `wake mute <agent>
    /// [--minutes N]`, `wake unmute <agent>`
    #[command(subcommand)]
    Wake(wake::WakeCommand),
    /// List recent runs of the [[hooks]] of config.toml (state, hook, agent, messages, times, exit)
    Hooks(hooks::HooksArgs),
    /// Print what an agent client's own hook shows the agent (unread mail, replies wanted):
    /// `hook session-start|prompt|stop --cli claude|codex --as <agent>`; quiet when there is none
    Hook(hooks::HookArgs),
    /// Register `agentmbx mcp` with the agent clients here (Claude Code, Codex), or remove it
    Setup(setup::SetupArgs),
    /// Serve MCP on stdin/stdout for an agent's client (Claude Code, Codex, …): the mailbox
    /// tools, through the running daemon
    #[command(
        long_about = "Serve MCP (Model Context Protocol) on stdin/stdout for an agent's client \
            (Claude Code, Codex, any MCP client), which starts it as `agentmbx mcp --as <agent>`.\n\n\
            Tools: mbx_whoami, mbx_send, mbx_reply, mbx_inbox, mbx_read, mbx_ack, mbx_thread, \
            mbx_search, mbx_agents, mbx_sent, mbx_replay, mbx_catchup, mbx_wait; the resource mbx://guide and the prompt mbx_guide \
            explain them. Every tool calls the running daemon of MBX_HOME; when it is not \
            running, every tool answers an error naming `agentmbx daemon` / `agentmbx daemon \
            install`. Stdout carries only the protocol; logs go to stderr (MBX_LOG, default warn).\n\n\
            Wake: the server declares `claude/channel` and sends Claude Code a channel \
            notification for new wake-worthy mail to its agent (request, task, decision, alert, \
            needs_reply, or an @mention; never status), as the daemon's wake brake allows (one \
            per 30 s, 6 per thread per hour, 60 per day, however many sessions run; `agentmbx \
            wake mute` silences it). It carries ids, sender and kind, never the body."
    )]
    Mcp(mcp::McpArgs),
    /// Print a shell completion script to stdout (bash, zsh, fish, elvish, powershell)
    Completions(completions::CompletionsArgs),
    /// Check this host's setup (identity, keys, daemon, peers, relay, outbox, service, disk)
    Doctor(doctor::DoctorArgs),
    /// Write the man pages into a directory (for packagers)
    #[command(hide = true)]
    Man(man::ManArgs),
    /// Print the local API's OpenAPI document
    #[command(hide = true)]
    Openapi,
}

/// The error classes the exit code is chosen by live with the local API's client, which
/// answers with them too ([`crate::local_api`]).
pub use crate::local_api::{NotFoundError, TempFailError, UsageError};

/// The full command definition, as `--help` and the man pages show it.
pub fn command() -> clap::Command {
    Cli::command()
}

impl Cli {
    /// The log level when `MBX_LOG` is unset: `info` for the long-running servers (`daemon`,
    /// `relay serve`), `error` for one-shot commands (the other `relay` subcommands included),
    /// whose results and warnings are their own output (a log line would repeat them).
    pub fn default_log_level(&self) -> &'static str {
        match self.command {
            Command::Daemon(_) | Command::Relay(relay::RelayCommand::Serve(_)) => "info",
            // A stdio server: nothing of its own on stdout, so warnings go to stderr (its
            // client's log).
            Command::Mcp(_) => "warn",
            _ => "error",
        }
    }
}

/// Parses the process arguments, runs the command, and turns the outcome into an exit code,
/// printing the error line on failure. `init_logging` runs after parsing succeeded, with the
/// command's default level.
pub fn main(init_logging: impl FnOnce(&'static str)) -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_failure(e),
    };
    init_logging(cli.default_log_level());
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let code = exit_code(&err);
            let mut line = format!("agentmbx: {}", render(&err));
            if code == EXIT_USAGE {
                line.push_str(&format!(" (see: {} --help)", command_path()));
            }
            eprintln!("{line}");
            ExitCode::from(code)
        }
    }
}

/// Runs one parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Init(args) => init::run(args),
        Command::Whoami(args) => whoami::run(args),
        Command::Daemon(args) => daemon::run(args),
        Command::Relay(cmd) => relay::run(cmd),
        Command::Config(cmd) => config::run(cmd),
        Command::Peers(args) => peers::run(args),
        Command::Pair(args) => pair::run(args),
        Command::Join(args) => pair::join(args),
        Command::Discover(args) => discover::run(args),
        Command::Host(cmd) => host::run(cmd),
        Command::Send(args) => mail::send(args),
        Command::Inbox(args) => mail::inbox(args),
        Command::Watch(args) => watch::run(args),
        Command::Read(args) => mail::read(args),
        Command::Reply(args) => mail::reply(args),
        Command::Thread(args) => mail::thread(args),
        Command::Search(args) => mail::search(args),
        Command::Ack(args) => mail::ack(args),
        Command::Sent(args) => mail::sent(args),
        Command::Setup(args) => setup::run(args),
        Command::Wake(cmd) => wake::run(cmd),
        Command::Hooks(args) => hooks::list(args),
        Command::Hook(args) => hooks::hook(args),
        Command::Mcp(args) => mcp::run(args),
        Command::Completions(args) => completions::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Man(args) => man::run(args),
        Command::Openapi => {
            print!("{}", agentmbx::api::openapi::document());
            Ok(())
        }
    }
}

/// The exit code for an error (`wire.md` §5), from the first cause in its chain that has one.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if cause.is::<UsageError>() || cause.is::<HostNameError>() {
            return EXIT_USAGE;
        }
        if cause.is::<NotFoundError>() {
            return EXIT_NOT_FOUND;
        }
        if cause.is::<TempFailError>() {
            return EXIT_TEMPFAIL;
        }
        if cause.is::<relay_admin::RelayRunning>() || relay_lock_held(cause) {
            return relay_admin::EXIT_RELAY_RUNNING;
        }
        if let Some(IdentityError::NotInitialized { .. }) = cause.downcast_ref::<IdentityError>() {
            return EXIT_NOT_FOUND;
        }
        if let Some(agentmbx::mailbox::MailboxError::NotFound(_)) =
            cause.downcast_ref::<agentmbx::mailbox::MailboxError>()
        {
            return EXIT_NOT_FOUND;
        }
    }
    EXIT_FAILURE
}

/// Whether `cause` says another relay process holds the store's `relay.lock` (`relay serve`
/// gave up waiting for it), or may run on it without one (a fresh heartbeat and no lock file).
fn relay_lock_held(cause: &(dyn std::error::Error + 'static)) -> bool {
    use agentmbx_relay::admin::AdminError;
    use agentmbx_relay::run::ServeError;
    use agentmbx_relay::store::StoreError;
    matches!(
        cause.downcast_ref::<ServeError>(),
        Some(ServeError::Store(
            StoreError::Locked { .. } | StoreError::LiveHeartbeat { .. }
        ))
    ) || matches!(
        cause.downcast_ref::<StoreError>(),
        Some(StoreError::Locked { .. } | StoreError::LiveHeartbeat { .. })
    ) || matches!(
        cause.downcast_ref::<AdminError>(),
        Some(AdminError::Store(StoreError::LiveHeartbeat { .. }))
    )
}

/// The error chain on one line, `outer: inner`, skipping a cause whose text the line already
/// holds (library errors often name their source in their own message). A socket, file or
/// HTTP client error is said in our words ([`agentmbx::net_error::describe`]: no URL, no
/// `(os error N)`).
pub fn render(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = if cause.is::<std::io::Error>() || cause.is::<reqwest::Error>() {
            agentmbx::net_error::describe(cause, None)
        } else {
            cause.to_string()
        };
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Prints a clap parse failure: help and version as clap does (exit 0), anything else as the
/// error line with exit code 2.
fn clap_failure(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(EXIT_USAGE)
        }
        _ => {
            eprintln!(
                "agentmbx: {} (see: {} --help)",
                clap_message(&e),
                command_path()
            );
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// clap's error as one line: the text before the usage block, continuation lines (such as the
/// names of missing arguments) joined with spaces.
fn clap_message(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let text: Vec<&str> = rendered
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
        .collect();
    let line = text.join(" ");
    let line = line.strip_prefix("error: ").unwrap_or(&line).to_string();
    if line.is_empty() {
        "invalid arguments".to_string()
    } else {
        line
    }
}

/// `agentmbx <sub> <sub>…` as far as the process arguments name known subcommands.
fn command_path() -> String {
    let mut cmd = command();
    let mut path = String::from("agentmbx");
    for arg in std::env::args().skip(1) {
        if arg.starts_with('-') {
            continue;
        }
        match cmd.find_subcommand(&arg) {
            Some(sub) => {
                path.push(' ');
                path.push_str(sub.get_name());
                let sub = sub.clone();
                cmd = sub;
            }
            None => break,
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        command().debug_assert();
    }

    #[test]
    fn each_mutation_gives_its_own_usage_example() {
        let help = |name: &str| {
            command()
                .find_subcommand_mut(name)
                .expect(name)
                .render_long_help()
                .to_string()
        };
        for (name, example) in [
            ("send", "2 usage error (e.g. a malformed --to address)"),
            (
                "reply",
                "2 usage error (e.g. an --idempotency-key with a space)",
            ),
            (
                "ack",
                "2 usage error (e.g. a note over 500 UTF-16 code units)",
            ),
        ] {
            let text = help(name);
            assert!(text.contains(example), "{name}: {text}");
            assert!(text.contains("75 (EX_TEMPFAIL)"), "{name}: {text}");
        }
        assert!(!help("send").contains("a note over"));
        assert!(!help("reply").contains("a note over"));
    }

    #[test]
    fn render_skips_repeated_causes() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let err = anyhow::Error::new(io)
            .context("reading x: gone")
            .context("starting");
        assert_eq!(render(&err), "starting: reading x: gone");
    }

    #[test]
    fn render_says_io_errors_in_our_words() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let io = std::net::TcpListener::bind(taken.local_addr().unwrap()).unwrap_err();
        let err = anyhow::Error::new(io).context("cannot bind the relay on 127.0.0.1:1");
        assert_eq!(
            render(&err),
            "cannot bind the relay on 127.0.0.1:1: address already in use"
        );
        let io = std::fs::read("/nonexistent/agentmbx-test").unwrap_err();
        assert_eq!(
            render(&anyhow::Error::new(io).context("reading x")),
            "reading x: no such file or directory"
        );
    }

    #[test]
    fn exit_codes() {
        let e = anyhow::Error::new(IdentityError::NotInitialized { path: "h".into() });
        assert_eq!(exit_code(&e), EXIT_NOT_FOUND);
        assert_eq!(
            exit_code(&anyhow::Error::new(UsageError("x".into()))),
            EXIT_USAGE
        );
        assert_eq!(exit_code(&anyhow::anyhow!("other")), EXIT_FAILURE);
        assert_eq!(
            exit_code(&anyhow::Error::new(TempFailError("x".into()))),
            EXIT_TEMPFAIL
        );
        let locked = agentmbx_relay::store::StoreError::Locked {
            path: "relay.lock".into(),
            holder: None,
            waited_ms: 60_000,
        };
        assert_eq!(
            exit_code(&anyhow::Error::new(agentmbx_relay::run::ServeError::Store(
                locked
            ))),
            relay_admin::EXIT_RELAY_RUNNING
        );
        let other = agentmbx_relay::store::StoreError::WriterStopped;
        assert_eq!(
            exit_code(&anyhow::Error::new(agentmbx_relay::run::ServeError::Store(
                other
            ))),
            EXIT_FAILURE
        );
    }

    #[test]
    fn only_the_servers_log_at_info_by_default() {
        let level = |args: &[&str]| {
            let mut full = vec!["agentmbx"];
            full.extend_from_slice(args);
            Cli::try_parse_from(full)
                .expect("parse")
                .default_log_level()
        };
        assert_eq!(level(&["daemon"]), "info");
        assert_eq!(level(&["relay", "serve", "--store-dir", "/x"]), "info");
        assert_eq!(level(&["relay", "keygen"]), "error");
        assert_eq!(
            level(&["relay", "revoke", "x", "--store-dir", "/x"]),
            "error"
        );
        assert_eq!(
            level(&["relay", "deny", "--list", "--store-dir", "/x"]),
            "error"
        );
        assert_eq!(level(&["relay", "quarantine"]), "error");
        assert_eq!(level(&["whoami"]), "error");
    }
}
