//! Hook runs in the store (issue 19 "Hooks", seed 003's at-most-once rule; the runner is
//! [`crate::hooks`]).
//!
//! - Intake: the trigger `deliveries_hook_inbox` (schema 11) queues every new delivery in
//!   `hook_inbox` in the transaction that commits it. [`intake`] matches queued rows against
//!   the configured hooks and, in one transaction, records each match in a `pending` run and
//!   removes the queued row: a delivery is matched once, ever, and a crash before or after
//!   that transaction neither skips nor repeats it.
//! - Coalescing: a match joins the newest `pending` run of its hook while that run's
//!   `due_at` (its first message's intake time + `debounce_ms`) is still ahead and it holds
//!   fewer than [`MAX_RUN_MESSAGES`]; else it opens a new run due at now + `debounce_ms`.
//! - A run moves `pending` → `started` ([`start`], committed before the command is spawned)
//!   → `ok` | `failed` | `timeout` ([`finish`]). [`recover`] (daemon start) turns every
//!   `started` run into `unknown`: whether its command ran, or how far, cannot be known, so it
//!   is never run again. `dropped`: the run's hook is no longer configured.
//! - Counts: kv `hook-count:<state>` counts the runs that ended in each end state, ever.
//! - Retention: [`prune`] keeps the newest [`KEEP_RUNS`] ended runs.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::MailboxError;
use crate::config::hooks::{HookConfig, MailFacts};

/// Most messages in one run: 500 (a longer burst opens another run).
pub const MAX_RUN_MESSAGES: i64 = 500;
/// Most message ids named in a run's environment (`MBX_HOOK_IDS`): 50.
pub const MAX_ENV_IDS: usize = 50;
/// Ended runs kept for `agentmbx hooks`: 1000.
pub const KEEP_RUNS: i64 = 1000;
/// Queued deliveries matched per [`intake`] call: 500.
pub const INTAKE_BATCH: usize = 500;

/// End states of a run ([`finish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The command exited 0.
    Ok,
    /// The command exited non-zero, died of a signal, or could not be started.
    Failed,
    /// The command outlived its `timeout_ms` and was killed.
    Timeout,
    /// The daemon stopped while the command ran (and killed it): how far it got is not known.
    Unknown,
}

impl Outcome {
    /// The state's name in `hook_runs.state`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed => "failed",
            Outcome::Timeout => "timeout",
            Outcome::Unknown => "unknown",
        }
    }
}

/// A run as `agentmbx hooks` lists it. Times are ms since the epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HookRun {
    /// Run id (grows with creation).
    pub id: i64,
    /// The hook's `name`.
    pub hook: String,
    /// The agent whose mail it is for.
    pub agent: String,
    /// `pending`, `started`, `ok`, `failed`, `timeout`, `unknown` or `dropped`.
    pub state: String,
    /// How many messages the run is for.
    pub count: i64,
    /// When the run was recorded.
    pub created_at: i64,
    /// When the command was spawned (`started` and later).
    pub started_at: Option<i64>,
    /// When the run ended.
    pub finished_at: Option<i64>,
    /// The command's exit code, when it exited.
    pub exit_code: Option<i64>,
    /// Why it failed, in our words (never output of the command).
    pub error: Option<String>,
}

/// What a started run's command is told ([`start`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunFacts {
    /// Run id.
    pub id: i64,
    /// The hook's `name`.
    pub hook: String,
    /// The agent.
    pub agent: String,
    /// How many messages.
    pub count: i64,
    /// The first [`MAX_ENV_IDS`] message ids, oldest first.
    pub ids: Vec<String>,
    /// Sender address of the first message.
    pub from: String,
    /// Thread id of the first message.
    pub thread: String,
    /// Kind of the first message.
    pub kind: String,
    /// `needs_reply` of the first message.
    pub needs_reply: bool,
}

/// Turns every `started` run into `unknown` (daemon start) and every `pending` run of a hook
/// not in `configured` into `dropped`. Returns (unknown, dropped) counts.
pub fn recover(
    conn: &Connection,
    configured: &[HookConfig],
    now_ms: i64,
) -> Result<(usize, usize), MailboxError> {
    let unknown = conn.execute(
        "UPDATE hook_runs SET state = 'unknown', finished_at = ?1,
           error = 'the daemon stopped while the command ran; it is not run again'
         WHERE state = 'started'",
        [now_ms],
    )?;
    count(conn, "unknown", unknown as i64)?;
    let names: Vec<String> = configured.iter().map(|h| h.name.clone()).collect();
    let names = serde_json::to_string(&names).unwrap_or_else(|_| "[]".into());
    let dropped = conn.execute(
        "UPDATE hook_runs SET state = 'dropped', finished_at = ?1,
           error = 'the hook is no longer in config.toml'
         WHERE state = 'pending' AND hook NOT IN (SELECT value FROM json_each(?2))",
        params![now_ms, names],
    )?;
    count(conn, "dropped", dropped as i64)?;
    Ok((unknown, dropped))
}

fn count(conn: &Connection, state: &str, n: i64) -> Result<(), MailboxError> {
    if n > 0 {
        conn.execute(
            "INSERT INTO kv(k, v) VALUES (?1, ?2)
             ON CONFLICT(k) DO UPDATE SET v = CAST(CAST(v AS INTEGER) + ?2 AS TEXT)",
            params![format!("hook-count:{state}"), n.to_string()],
        )?;
    }
    Ok(())
}

/// Runs that ended in each end state, ever (kv `hook-count:<state>`), as (state, count).
pub fn counts(conn: &Connection) -> Result<Vec<(String, i64)>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT substr(k, 12), CAST(v AS INTEGER) FROM kv WHERE k LIKE 'hook-count:%' ORDER BY k",
    )?;
    let rows = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

/// Matches up to [`INTAKE_BATCH`] queued deliveries against `hooks` (for host `host`), records
/// the matches in pending runs and removes the queued rows. Call it in one transaction (the
/// runner uses an immediate one). Returns how many queued rows it consumed.
pub fn intake(
    conn: &Connection,
    hooks: &[HookConfig],
    host: &str,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    type Row = (
        i64,
        String,
        String,
        Option<(String, String, String, String, bool)>,
    );
    let rows: Vec<Row> = conn
        .prepare_cached(
            "SELECT q.seq, q.msg_id, q.agent, m.from_addr, m.kind, m.subject, m.body,
                    COALESCE(json_extract(m.envelope, '$.needs_reply'), 0), m.id
             FROM hook_inbox q LEFT JOIN messages m ON m.id = q.msg_id
             ORDER BY q.seq LIMIT ?1",
        )?
        .query_map([INTAKE_BATCH as i64], |r| {
            let found: Option<String> = r.get(8)?;
            let mail = match found {
                Some(_) => Some((
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get::<_, i64>(7)? != 0,
                )),
                None => None,
            };
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, mail))
        })?
        .collect::<Result<_, _>>()?;
    for (seq, msg_id, agent, mail) in &rows {
        if let Some((from, kind, subject, body, needs_reply)) = mail {
            let facts = MailFacts {
                from,
                kind,
                needs_reply: *needs_reply,
                subject,
                body,
            };
            for hook in hooks.iter().filter(|h| h.matches(agent, host, &facts)) {
                add_to_run(conn, hook, msg_id, now_ms)?;
            }
        }
        conn.execute("DELETE FROM hook_inbox WHERE seq = ?1", [seq])?;
    }
    Ok(rows.len())
}

/// Adds `msg_id` to the open pending run of `hook`, or to a new one (module docs).
fn add_to_run(
    conn: &Connection,
    hook: &HookConfig,
    msg_id: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let known: bool = conn
        .query_row(
            "SELECT 1 FROM hook_run_messages WHERE hook = ?1 AND msg_id = ?2",
            params![hook.name, msg_id],
            |_| Ok(()),
        )
        .optional()?
        .is_some();
    if known {
        return Ok(());
    }
    let open: Option<i64> = conn
        .query_row(
            "SELECT id FROM hook_runs WHERE hook = ?1 AND state = 'pending' AND due_at > ?2
               AND count < ?3 ORDER BY id DESC LIMIT 1",
            params![hook.name, now_ms, MAX_RUN_MESSAGES],
            |r| r.get(0),
        )
        .optional()?;
    let run = match open {
        Some(id) => id,
        None => {
            conn.execute(
                "INSERT INTO hook_runs(hook, agent, state, count, created_at, due_at)
                 VALUES (?1, ?2, 'pending', 0, ?3, ?4)",
                params![
                    hook.name,
                    hook.agent,
                    now_ms,
                    now_ms.saturating_add(hook.debounce_ms as i64)
                ],
            )?;
            conn.last_insert_rowid()
        }
    };
    conn.execute(
        "INSERT INTO hook_run_messages(hook, msg_id, run) VALUES (?1, ?2, ?3)",
        params![hook.name, msg_id, run],
    )?;
    conn.execute(
        "UPDATE hook_runs SET count = count + 1 WHERE id = ?1",
        [run],
    )?;
    Ok(())
}

/// Whether deliveries wait in the queue for [`intake`].
pub fn queued(conn: &Connection) -> Result<bool, MailboxError> {
    Ok(conn
        .query_row("SELECT 1 FROM hook_inbox LIMIT 1", [], |_| Ok(()))
        .optional()?
        .is_some())
}

/// Pending runs due at `now_ms`, oldest due first, at most `limit`: (id, hook).
pub fn due(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
) -> Result<Vec<(i64, String)>, MailboxError> {
    let mut st = conn.prepare_cached(
        "SELECT id, hook FROM hook_runs WHERE state = 'pending' AND due_at <= ?1
         ORDER BY due_at, id LIMIT ?2",
    )?;
    let rows = st
        .query_map(params![now_ms, limit as i64], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

/// The earliest `due_at` of a pending run (ms), if any.
pub fn next_due(conn: &Connection) -> Result<Option<i64>, MailboxError> {
    Ok(conn.query_row(
        "SELECT MIN(due_at) FROM hook_runs WHERE state = 'pending'",
        [],
        |r| r.get(0),
    )?)
}

/// Marks pending run `id` `started` at `now_ms` and returns what its command is told; `None`
/// when it is not pending (another start took it). Commit before spawning the command.
pub fn start(conn: &Connection, id: i64, now_ms: i64) -> Result<Option<RunFacts>, MailboxError> {
    let changed = conn.execute(
        "UPDATE hook_runs SET state = 'started', started_at = ?2 WHERE id = ?1 AND state = 'pending'",
        params![id, now_ms],
    )?;
    if changed == 0 {
        return Ok(None);
    }
    let (hook, agent, count): (String, String, i64) = conn.query_row(
        "SELECT hook, agent, count FROM hook_runs WHERE id = ?1",
        [id],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    let mut st = conn.prepare_cached(
        "SELECT x.msg_id, m.from_addr, m.thread, m.kind,
                COALESCE(json_extract(m.envelope, '$.needs_reply'), 0)
         FROM hook_run_messages x JOIN messages m ON m.id = x.msg_id
         WHERE x.run = ?1 ORDER BY x.rowid LIMIT ?2",
    )?;
    let msgs: Vec<(String, String, String, String, i64)> = st
        .query_map(params![id, MAX_ENV_IDS as i64], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect::<Result<_, _>>()?;
    let first = msgs.first().cloned().unwrap_or_default();
    Ok(Some(RunFacts {
        id,
        hook,
        agent,
        count,
        ids: msgs.into_iter().map(|m| m.0).collect(),
        from: first.1,
        thread: first.2,
        kind: first.3,
        needs_reply: first.4 != 0,
    }))
}

/// Ends started run `id` with `outcome` at `now_ms` (and counts it). A run that is not
/// `started` is left as it is (returns false).
pub fn finish(
    conn: &Connection,
    id: i64,
    outcome: Outcome,
    exit_code: Option<i32>,
    error: Option<&str>,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE hook_runs SET state = ?2, finished_at = ?3, exit_code = ?4, error = ?5
         WHERE id = ?1 AND state = 'started'",
        params![id, outcome.as_str(), now_ms, exit_code, error],
    )?;
    count(conn, outcome.as_str(), n as i64)?;
    Ok(n > 0)
}

/// Deletes ended runs (and their message lists) past the newest [`KEEP_RUNS`] ended ones.
/// Returns how many runs it deleted.
pub fn prune(conn: &Connection) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        "DELETE FROM hook_runs WHERE state NOT IN ('pending', 'started') AND id NOT IN
           (SELECT id FROM hook_runs WHERE state NOT IN ('pending', 'started')
            ORDER BY id DESC LIMIT ?1)",
        [KEEP_RUNS],
    )?)
}

/// The newest `limit` runs, newest first.
pub fn list(conn: &Connection, limit: usize) -> Result<Vec<HookRun>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT id, hook, agent, state, count, created_at, started_at, finished_at, exit_code,
                error
         FROM hook_runs ORDER BY id DESC LIMIT ?1",
    )?;
    let rows = st
        .query_map([limit as i64], |r| {
            Ok(HookRun {
                id: r.get(0)?,
                hook: r.get(1)?,
                agent: r.get(2)?,
                state: r.get(3)?,
                count: r.get(4)?,
                created_at: r.get(5)?,
                started_at: r.get(6)?,
                finished_at: r.get(7)?,
                exit_code: r.get(8)?,
                error: r.get(9)?,
            })
        })?
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::messages;
    use crate::testutil::{self, T0};

    fn hook(name: &str, debounce_ms: u64) -> HookConfig {
        HookConfig {
            name: name.into(),
            agent: "bob".into(),
            command: vec!["/bin/true".into()],
            from: None,
            kind: None,
            needs_reply: None,
            wake_worthy: None,
            timeout_ms: 1000,
            debounce_ms,
        }
    }

    fn deliver(mb: &crate::mailbox::Mailbox, id: &str, kind: &str) {
        let env = serde_json::json!({"id": id, "ts": "2026-01-01T00:00:00.000Z",
            "from": "alice@home", "to": ["bob@home"], "thread": format!("t-{id}"), "kind": kind,
            "subject": "secret subject", "body": "secret body", "needs_reply": true});
        mb.with(|c| {
            let tx = c.transaction()?;
            messages::insert(&tx, &env, "local", T0)?;
            messages::deliver(&tx, id, "bob", T0)?;
            tx.commit()?;
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn a_delivery_is_queued_in_its_own_transaction_and_matched_once() {
        let store = testutil::store();
        let mb = store.mailbox.clone();
        // Rolled back: nothing queued.
        mb.with(|c| {
            let tx = c.transaction()?;
            let env = serde_json::json!({"id": "m0", "ts": "2026-01-01T00:00:00.000Z",
                "from": "alice@home", "to": ["bob@home"], "thread": "t", "kind": "request",
                "subject": "s", "body": "b"});
            messages::insert(&tx, &env, "local", T0)?;
            messages::deliver(&tx, "m0", "bob", T0)?;
            tx.rollback()?;
            Ok(())
        })
        .unwrap();
        assert!(!mb.with(|c| queued(c)).unwrap());
        deliver(&mb, "m1", "request");
        assert!(mb.with(|c| queued(c)).unwrap());
        let hooks = [hook("h1", 0), hook("h2", 0)];
        assert_eq!(mb.with(|c| intake(c, &hooks, "home", T0)).unwrap(), 1);
        assert_eq!(mb.with(|c| intake(c, &hooks, "home", T0)).unwrap(), 0);
        let runs = mb.with(|c| list(c, 10)).unwrap();
        assert_eq!(runs.len(), 2, "one run per hook");
        assert!(runs.iter().all(|r| r.state == "pending" && r.count == 1));
        // h1's run started, then recovered as unknown; never due again. (Newest first: h2's
        // run is runs[0].)
        assert_eq!(runs[1].hook, "h1");
        let facts = mb.with(|c| start(c, runs[1].id, T0)).unwrap().unwrap();
        assert_eq!(facts.ids, vec!["m1".to_string()]);
        assert_eq!(facts.from, "alice@home");
        assert_eq!(facts.thread, "t-m1");
        assert!(facts.needs_reply);
        assert!(mb.with(|c| start(c, runs[1].id, T0)).unwrap().is_none());
        let (unknown, dropped) = mb.with(|c| recover(c, &hooks[..1], T0)).unwrap();
        assert_eq!((unknown, dropped), (1, 1), "h2 is no longer configured");
        assert!(mb.with(|c| due(c, T0 + 10_000, 10)).unwrap().is_empty());
        let counts = mb.with(|c| counts(c)).unwrap();
        assert!(counts.contains(&("unknown".to_string(), 1)), "{counts:?}");
        assert!(!mb
            .with(|c| finish(c, runs[1].id, Outcome::Ok, Some(0), None, T0))
            .unwrap());
    }

    #[test]
    fn a_burst_within_the_debounce_window_shares_one_run_and_unworthy_mail_runs_nothing() {
        let store = testutil::store();
        let mb = store.mailbox.clone();
        let hooks = [hook("h1", 1000)];
        deliver(&mb, "m1", "request");
        mb.with(|c| intake(c, &hooks, "home", T0)).unwrap();
        deliver(&mb, "m2", "task");
        deliver(&mb, "s1", "status");
        mb.with(|c| intake(c, &hooks, "home", T0 + 500)).unwrap();
        assert!(mb.with(|c| due(c, T0 + 999, 10)).unwrap().is_empty());
        let due_now = mb.with(|c| due(c, T0 + 1000, 10)).unwrap();
        assert_eq!(due_now.len(), 1);
        let facts = mb
            .with(|c| start(c, due_now[0].0, T0 + 1000))
            .unwrap()
            .unwrap();
        assert_eq!(facts.count, 2);
        assert_eq!(facts.ids, vec!["m1".to_string(), "m2".to_string()]);
        // Past the window: a new run.
        deliver(&mb, "m3", "request");
        mb.with(|c| intake(c, &hooks, "home", T0 + 1500)).unwrap();
        let runs = mb.with(|c| list(c, 10)).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].count, 1);
        assert!(mb
            .with(|c| finish(
                c,
                facts.id,
                Outcome::Timeout,
                None,
                Some("killed"),
                T0 + 2000
            ))
            .unwrap());
        assert_eq!(mb.with(|c| next_due(c)).unwrap(), Some(T0 + 2500));
    }

    #[test]
    fn a_run_of_60_messages_names_the_first_50_oldest_first() {
        let store = testutil::store();
        let mb = store.mailbox.clone();
        let hooks = [hook("h1", 60_000)];
        for i in 0..60 {
            deliver(&mb, &format!("m{i:02}"), "request");
        }
        mb.with(|c| intake(c, &hooks, "home", T0)).unwrap();
        let due_now = mb.with(|c| due(c, T0 + 60_000, 10)).unwrap();
        let facts = mb.with(|c| start(c, due_now[0].0, T0)).unwrap().unwrap();
        assert_eq!(facts.count, 60);
        assert_eq!(facts.ids.len(), MAX_ENV_IDS);
        assert_eq!(facts.ids[0], "m00");
        assert_eq!(facts.ids[49], "m49");
    }

    #[test]
    fn prune_keeps_the_newest_ended_runs_and_every_open_one() {
        let store = testutil::store();
        let mb = store.mailbox.clone();
        mb.with(|c| {
            for i in 0..(KEEP_RUNS + 5) {
                c.execute(
                    "INSERT INTO hook_runs(hook, agent, state, created_at, due_at)
                     VALUES ('h', 'bob', ?1, 0, 0)",
                    [if i == 0 { "pending" } else { "ok" }],
                )?;
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(mb.with(|c| prune(c)).unwrap(), 4);
        let left: i64 = mb
            .with(|c| Ok(c.query_row("SELECT COUNT(*) FROM hook_runs", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(left, KEEP_RUNS + 1);
    }
}
