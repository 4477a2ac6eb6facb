//! Hooks (issue 19 part 2): commands the daemon runs for new mail, at most once per message
//! and hook across restarts (seed 003). Configuration: [`config`] (`[[hooks]]` in
//! `config.toml`); the store side (queue, runs, states): [`crate::mailbox::hooks`].
//!
//! The runner ([`run`]) is one task of the daemon. At start it turns runs left `started` by
//! a previous daemon into `unknown` (never re-run) and runs the `pending` ones. Then, woken by
//! the mailbox's wake hub when mail for a hooked agent is committed (and at the latest every
//! [`IDLE_POLL_MS`], for mail another process committed; with no hook configured it only
//! waits for the stop after recovery), it matches queued deliveries into
//! runs, and starts each due run while fewer than `hook_concurrency` commands run: the run is
//! marked `started` in a committed transaction BEFORE its command is spawned, and `ok`,
//! `failed` or `timeout` after it ends. A failure or a timeout is logged (hook name, run id,
//! exit status; never the command's output) and counted; it never blocks delivery.
//!
//! The command is run directly (no shell unless the command names one), in its own process
//! group, with stdin, stdout and stderr at `/dev/null`, in the home directory, with the
//! daemon's environment plus:
//!
//! | variable | value |
//! |---|---|
//! | `MBX_HOOK_NAME` | the hook's `name` |
//! | `MBX_HOOK_RUN` | the run id (as `agentmbx hooks` lists it) |
//! | `MBX_HOOK_AGENT` | the agent the mail is for |
//! | `MBX_HOOK_COUNT` | how many messages the run is for (1 unless a burst was coalesced) |
//! | `MBX_HOOK_IDS` | their ids, oldest first, comma-separated, at most 50 |
//! | `MBX_HOOK_IDS_TRUNCATED` | `1` when the run has more than 50 messages (else unset) |
//! | `MBX_HOOK_FROM` | sender address (`name@host`) of the first message |
//! | `MBX_HOOK_THREAD` | thread id of the first message (sender-chosen text; control characters become spaces) |
//! | `MBX_HOOK_KIND` | kind of the first message |
//! | `MBX_HOOK_NEEDS_REPLY` | `1` or `0`, of the first message |
//! | `MBX_HOME` | the agentmbx home directory |
//! | `MBX_AGENT` | the hook's agent (so `agentmbx` commands the hook runs act as it) |
//!
//! Never the subject or the body: a hook that wants them reads the message through the local
//! API with the ids it is given. On timeout the whole process group is killed (SIGKILL) and
//! the run ends `timeout`. When the daemon stops, running commands are killed and their runs
//! end `unknown` (how far they got is not known); they are not run again.

/// The `[[hooks]]` settings are configuration: [`crate::config::hooks`], re-exported here.
pub use crate::config::hooks as config;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentmbx_protocol::clock::SharedClock;
use tokio::sync::{watch, Notify, Semaphore};

use crate::config::hooks::HookConfig;
use crate::mailbox::hooks::{self as store, Outcome, RunFacts};
use crate::mailbox::{Mailbox, MailboxError};

/// Longest sleep of an idle runner (ms): 10 s. It looks for mail another process committed
/// at this pace; mail the daemon commits wakes it at once.
pub const IDLE_POLL_MS: u64 = 10_000;

/// What the runner needs.
#[derive(Clone)]
pub struct Runner {
    /// The store.
    pub mailbox: Mailbox,
    /// The configured hooks (read at start).
    pub hooks: Arc<Vec<HookConfig>>,
    /// Most commands at once (`hook_concurrency`).
    pub concurrency: u32,
    /// This host's name (the wake-worthy rule's `@agent@host`).
    pub host: String,
    /// The home directory (`MBX_HOME`, the command's working directory).
    pub home: PathBuf,
    /// The clock.
    pub clock: SharedClock,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Hook names only: a command line may hold what the owner would not log.
        let names: Vec<&str> = self.hooks.iter().map(|h| h.name.as_str()).collect();
        f.debug_struct("Runner")
            .field("hooks", &names)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

/// Runs hooks until `stop` turns true (module docs). Store errors are logged and retried at
/// the next pass.
pub async fn run(runner: Runner, mut stop: watch::Receiver<bool>) {
    // Recovery first, retried until it is done: no run may start while an earlier daemon's
    // `started` runs are not yet `unknown`, and no run of an unconfigured hook may stay due.
    loop {
        let now = runner.clock.now_ms();
        let hooks = runner.hooks.clone();
        let recovered = runner
            .mailbox
            .run(move |c| {
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let r = store::recover(&tx, &hooks, now)?;
                store::prune(&tx)?;
                tx.commit()?;
                Ok(r)
            })
            .await;
        match recovered {
            Ok((0, 0)) => break,
            Ok((unknown, dropped)) => {
                tracing::warn!(
                    unknown,
                    dropped,
                    "hook runs left by the previous daemon: started ones are now `unknown` and are not run again"
                );
                break;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot recover hook runs; trying again in 1 s");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }
    }
    // No hook configured (they are read at start): nothing can become due, so an idle daemon
    // does not wake every IDLE_POLL_MS for nothing.
    if runner.hooks.is_empty() {
        let _ = stop.wait_for(|s| *s).await;
        return;
    }
    // Wake on commits of mail for any hooked agent.
    let woke = Arc::new(Notify::new());
    let mut agents: Vec<&str> = runner.hooks.iter().map(|h| h.agent.as_str()).collect();
    agents.sort_unstable();
    agents.dedup();
    let mut forwarders = Vec::new();
    for agent in agents {
        let mut rx = runner.mailbox.waits().subscribe(agent);
        let (woke, mut stop) = (woke.clone(), stop.clone());
        forwarders.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = rx.changed() => if r.is_err() { break } else { woke.notify_one() },
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
        }));
    }
    let by_name: HashMap<String, HookConfig> = runner
        .hooks
        .iter()
        .map(|h| (h.name.clone(), h.clone()))
        .collect();
    let slots = Arc::new(Semaphore::new(runner.concurrency.max(1) as usize));
    let ended = Arc::new(Notify::new());
    let (kill_tx, _) = watch::channel(false);
    let mut running = tokio::task::JoinSet::new();
    let mut passes: u64 = 0;
    loop {
        while running.try_join_next().is_some() {}
        let wait_ms = match pass(&runner, &by_name, &slots, &ended, &kill_tx, &mut running).await {
            Ok(next_due) => next_due,
            Err(e) => {
                tracing::warn!(error = %e, "hook pass failed; trying again shortly");
                Some(1000)
            }
        };
        passes += 1;
        if passes.is_multiple_of(100) {
            let _ = runner.mailbox.run(|c| store::prune(c)).await;
        }
        let sleep_ms = wait_ms.unwrap_or(IDLE_POLL_MS).clamp(1, IDLE_POLL_MS);
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = woke.notified() => {}
            _ = ended.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(sleep_ms)) => {}
        }
    }
    // Shutdown: kill what runs; each run ends `unknown`.
    kill_tx.send_replace(true);
    while running.join_next().await.is_some() {}
    for f in forwarders {
        f.abort();
    }
    let _ = runner.mailbox.run(|c| store::prune(c)).await;
}

/// One pass: match queued mail, start due runs while slots are free. Returns ms until the
/// next pending run is due (`None`: none pending, or no free slot, in which case a run
/// ending wakes the runner).
async fn pass(
    runner: &Runner,
    hooks: &HashMap<String, HookConfig>,
    slots: &Arc<Semaphore>,
    ended: &Arc<Notify>,
    kill: &watch::Sender<bool>,
    running: &mut tokio::task::JoinSet<()>,
) -> Result<Option<u64>, MailboxError> {
    loop {
        let (all, host, now) = (
            runner.hooks.clone(),
            runner.host.clone(),
            runner.clock.now_ms(),
        );
        let consumed = runner
            .mailbox
            .run(move |c| {
                // A read first: an idle pass takes no write lock.
                if !store::queued(c)? {
                    return Ok(0);
                }
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let n = store::intake(&tx, &all, &host, now)?;
                tx.commit()?;
                Ok(n)
            })
            .await?;
        if consumed < store::INTAKE_BATCH {
            break;
        }
    }
    loop {
        let free = slots.available_permits();
        if free == 0 {
            return Ok(None);
        }
        let now = runner.clock.now_ms();
        let due = runner
            .mailbox
            .run(move |c| store::due(c, now, free))
            .await?;
        if due.is_empty() {
            break;
        }
        let mut started = 0;
        for (id, name) in due {
            // Runs of hooks no longer configured were dropped at start ([`store::recover`]).
            let Some(hook) = hooks.get(&name).cloned() else {
                continue;
            };
            started += 1;
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                return Ok(None);
            };
            let now = runner.clock.now_ms();
            // Committed before the spawn: a crash from here on leaves the run `started`,
            // which the next start turns into `unknown`.
            let facts = runner
                .mailbox
                .run(move |c| {
                    let tx =
                        c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                    let f = store::start(&tx, id, now)?;
                    tx.commit()?;
                    Ok(f)
                })
                .await?;
            let Some(facts) = facts else { continue };
            let (runner, ended, kill) = (runner.clone(), ended.clone(), kill.subscribe());
            running.spawn(async move {
                let (outcome, code, error) = execute(&runner, &hook, &facts, kill).await;
                let (id, now) = (facts.id, runner.clock.now_ms());
                match outcome {
                    Outcome::Ok => tracing::info!(hook = %hook.name, run = id, count = facts.count, "hook ran"),
                    _ => tracing::warn!(hook = %hook.name, run = id, state = outcome.as_str(),
                        exit_code = ?code, error = error.as_deref().unwrap_or(""), "hook run did not succeed"),
                }
                let err2 = error.clone();
                if let Err(e) = runner
                    .mailbox
                    .run(move |c| store::finish(c, id, outcome, code, err2.as_deref(), now))
                    .await
                {
                    tracing::error!(hook = %hook.name, run = id, error = %e,
                        "cannot record the end of a hook run; it stays `started` and becomes `unknown` at the next start");
                }
                drop(permit);
                ended.notify_one();
            });
        }
        if started == 0 {
            break;
        }
    }
    let next = runner.mailbox.run(|c| store::next_due(c)).await?;
    Ok(next.map(|due| (due - runner.clock.now_ms()).max(1) as u64))
}

/// The environment a run's command gets on top of the daemon's (module docs).
pub fn run_env(facts: &RunFacts, home: &std::path::Path) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("MBX_HOOK_NAME", facts.hook.clone()),
        ("MBX_HOOK_RUN", facts.id.to_string()),
        ("MBX_HOOK_AGENT", facts.agent.clone()),
        ("MBX_HOOK_COUNT", facts.count.to_string()),
        ("MBX_HOOK_IDS", facts.ids.join(",")),
        ("MBX_HOOK_FROM", facts.from.clone()),
        // Sender-chosen text: control characters (NUL, ESC, line breaks) become spaces, so a
        // sender can neither make the spawn fail nor put lines or escapes into a script.
        ("MBX_HOOK_THREAD", without_controls(&facts.thread)),
        ("MBX_HOOK_KIND", facts.kind.clone()),
        (
            "MBX_HOOK_NEEDS_REPLY",
            if facts.needs_reply { "1" } else { "0" }.to_string(),
        ),
        ("MBX_HOME", home.display().to_string()),
        // An `agentmbx` command the hook runs acts as the hook's agent, never as one the
        // daemon's own environment named.
        ("MBX_AGENT", facts.agent.clone()),
    ];
    if facts.count > facts.ids.len() as i64 {
        env.push(("MBX_HOOK_IDS_TRUNCATED", "1".into()));
    }
    env
}

/// `text` with every control character replaced by a space.
fn without_controls(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Runs one command to its end, its timeout, or the daemon's stop.
async fn execute(
    runner: &Runner,
    hook: &HookConfig,
    facts: &RunFacts,
    mut kill: watch::Receiver<bool>,
) -> (Outcome, Option<i32>, Option<String>) {
    let mut cmd = tokio::process::Command::new(&hook.command[0]);
    cmd.args(&hook.command[1..])
        .env_remove("MBX_HOOK_IDS_TRUNCATED")
        .envs(run_env(facts, &runner.home))
        .current_dir(&runner.home)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    #[cfg(unix)]
    cmd.process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return (
                Outcome::Failed,
                None,
                Some(format!("cannot start {:?}: {e}", hook.command[0])),
            )
        }
    };
    let pid = child.id();
    let kill_group = || {
        #[cfg(unix)]
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            // The child leads its own process group (process_group(0) above).
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    };
    let timeout = tokio::time::sleep(Duration::from_millis(hook.timeout_ms));
    tokio::select! {
        status = child.wait() => match status {
            Ok(s) if s.success() => (Outcome::Ok, Some(0), None),
            Ok(s) => {
                let error = match s.code() {
                    Some(c) => format!("exited with status {c}"),
                    None => "killed by a signal".to_string(),
                };
                (Outcome::Failed, s.code(), Some(error))
            }
            Err(e) => (Outcome::Failed, None, Some(format!("cannot wait for the command: {e}"))),
        },
        _ = timeout => {
            kill_group();
            let _ = child.wait().await;
            (Outcome::Timeout, None, Some(format!("killed after timeout_ms {}", hook.timeout_ms)))
        }
        _ = async { let _ = kill.wait_for(|k| *k).await; } => {
            kill_group();
            let _ = child.wait().await;
            (Outcome::Unknown, None,
             Some("the daemon stopped while the command ran; it was killed and is not run again".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(count: i64, ids: usize) -> RunFacts {
        RunFacts {
            id: 7,
            hook: "h".into(),
            agent: "bob".into(),
            count,
            ids: (0..ids).map(|i| format!("m{i}")).collect(),
            from: "alice@home".into(),
            thread: "t".into(),
            kind: "request".into(),
            needs_reply: false,
        }
    }

    #[test]
    fn the_environment_names_at_most_50_ids_and_says_when_it_cut_the_list() {
        let home = std::path::Path::new("/h");
        let env = run_env(&facts(1, 1), home);
        let get = |env: &[(&str, String)], k: &str| {
            env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        };
        assert_eq!(get(&env, "MBX_HOOK_IDS").as_deref(), Some("m0"));
        assert_eq!(get(&env, "MBX_HOOK_NEEDS_REPLY").as_deref(), Some("0"));
        assert_eq!(get(&env, "MBX_HOOK_IDS_TRUNCATED"), None);
        let many = run_env(&facts(60, store::MAX_ENV_IDS), home);
        assert_eq!(get(&many, "MBX_HOOK_COUNT").as_deref(), Some("60"));
        assert_eq!(
            get(&many, "MBX_HOOK_IDS").map(|v| v.split(',').count()),
            Some(50)
        );
        assert_eq!(get(&many, "MBX_HOOK_IDS_TRUNCATED").as_deref(), Some("1"));
        assert_eq!(get(&many, "MBX_HOME").as_deref(), Some("/h"));
    }

    #[test]
    fn a_senders_thread_reaches_the_environment_without_control_characters() {
        let mut f = facts(1, 1);
        f.thread = "plan\0\n\u{1b}[31mred".into();
        let env = run_env(&f, std::path::Path::new("/h"));
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get("MBX_HOOK_THREAD").as_deref(), Some("plan   [31mred"));
        assert_eq!(get("MBX_AGENT").as_deref(), Some("bob"));
    }
}
