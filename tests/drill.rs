//! The randomized crash drill (spec §5): two paired hosts, `hosta` and `hostb`, and one relay,
//! all real `agentmbx` child processes; the hosts have no LAN address for each other, so every
//! message and every delivery receipt goes through the relay. Two sender threads keep sending
//! through the local API (alice@hosta → bob@hostb and bob@hostb → alice@hosta) while, many
//! times, one of the three processes — chosen at random — is SIGKILLed at a random moment and
//! restarted on the same store (the relay on the same port). A restarted process is, half of
//! the time, armed with a random failpoint of its kind (`MBX_FAILPOINTS`, `name@n`); the next
//! time it is the victim it is killed when it reports that point (or when a random wait runs
//! out first). A process stays armed only while enough kills remain to clear it, so every
//! process runs unarmed at the end.
//!
//! Every send carries an `Idempotency-Key`. A send whose answer was lost (the daemon died, the
//! connection broke) is retried with the same key until it gets its 201, after a restart when
//! the daemon was down; the daemon records the key in the message's transaction, so every send
//! ends acknowledged with one message id, and no send is left "unknown".
//!
//! After the last kill the senders stop, the drill waits for quiescence (every acknowledged
//! message stored at its receiver, no pending outbox row or delivery receipt, the relay queue
//! empty) and then asserts: every acknowledged message is stored exactly once at its receiver
//! (`messages`, `deliveries`), no message exists that was not acknowledged (at the receiver, or
//! a second one at the sender), each item is at the relay once and each sender's accept carries
//! the relay's original seq and time (`dedup`; a row whose delivery receipt arrived before the
//! push's answer was recorded — the sender died with it unread — is settled without an accept
//! and counted as `settled_before_accept`), no seq was given twice, every outbox row is settled
//! by its delivery receipt, the relay queue is drained, nothing is in quarantine and the epoch
//! never changed. It prints the seed, the kills (one line each, then a summary), the messages,
//! lost, duplicated and the elapsed time with the time per kill.
//!
//! Parameters (environment):
//! - `MBX_DRILL_KILLS`: number of kills (default 20, about 20 s on 2 cores);
//! - `MBX_DRILL_SEED`: the seed of the victims, delays and failpoints (decimal or `0x` hex;
//!   default random, always printed). Timing still varies between runs of one seed;
//! - `MBX_DRILL_LOG_DIR`: when set, the log of every killed process and the final logs are
//!   written there (`<kill>-<process>.log`).
//!
//! The long run (≥ 1,000 kills) is the same test with a larger count:
//!
//! ```text
//! MBX_DRILL_KILLS=1000 cargo nextest run -p agentmbx --test integration -E 'test(/^drill::/)' --no-capture
//! ```
//!
//! A kill costs about 0.6–0.8 s on 2 cores (random wait, SIGKILL, restart) and about 25
//! messages are sent per kill; quiescence takes 5–15 s. 1,000 kills therefore take roughly
//! 10–15 minutes. nextest's slow-test notices are only notices; a CI profile with a hard
//! timeout needs it raised for such a run.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::helper::mesh::{Host, Mesh};
use crate::helper::POLL;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rusqlite::Connection;
use serde_json::{json, Value};

/// Kills when `MBX_DRILL_KILLS` is unset (CI).
const DEFAULT_KILLS: u64 = 20;

/// Failpoints of the relay process.
const RELAY_POINTS: &[&str] = &[
    "push:before-commit",
    "push:after-commit",
    "pull:before-response",
    "ack:before-commit",
    "ack:after-commit",
];

/// Failpoints of a daemon (sender and receiver side).
const HOST_POINTS: &[&str] = &[
    "push:before-send",
    "push:after-response",
    "receive:after-deliver",
    "ack:before-send",
    "ack:after-response",
];

/// Random wait before a plain kill (ms).
const KILL_DELAY_MS: std::ops::Range<u64> = 100..1500;
/// Longest random wait for an armed victim to reach its failpoint (ms).
const FAILPOINT_WAIT_MS: std::ops::Range<u64> = 200..2000;
/// Think time of a sender between two messages (ms).
const PACE_MS: std::ops::Range<u64> = 10..60;
/// Read timeout of one local API call; a longer silence is a lost answer, retried.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one send may stay unanswered (daemon down or failing) before the drill fails.
const DAEMON_DOWN_LIMIT: Duration = Duration::from_secs(120);
/// Quiescence is waited for this long after the latest pending retry is due.
const QUIESCENCE: Duration = Duration::from_secs(90);

/// One of the three processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proc {
    Relay,
    A,
    B,
}

impl Proc {
    const ALL: [Proc; 3] = [Proc::Relay, Proc::A, Proc::B];

    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Proc::Relay => "relay",
            Proc::A => "hosta",
            Proc::B => "hostb",
        }
    }

    fn points(self) -> &'static [&'static str] {
        match self {
            Proc::Relay => RELAY_POINTS,
            Proc::A | Proc::B => HOST_POINTS,
        }
    }
}

/// Where a sender thread reaches its daemon: the API address while it runs, `None` while it
/// is down (set before the kill, reset after the restart).
#[derive(Debug)]
struct Api {
    addr: Mutex<Option<SocketAddr>>,
    token: String,
}

impl Api {
    fn set(&self, addr: Option<SocketAddr>) {
        *self.addr.lock().expect("api lock") = addr;
    }

    fn get(&self) -> Option<SocketAddr> {
        *self.addr.lock().expect("api lock")
    }
}

/// One acknowledged send.
#[derive(Debug, Clone)]
struct Sent {
    key: String,
    id: String,
}

/// What a sender thread did.
#[derive(Debug, Default)]
struct SenderReport {
    sent: Vec<Sent>,
    /// Sends answered only on a later attempt (lost answer, dead or restarting daemon).
    retried: u64,
}

/// `u64` from decimal or `0x` hex.
fn parse_u64(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        parse_u64(&v).unwrap_or_else(|| panic!("{name}={v:?} is not a non-negative integer"))
    })
}

/// `POST /v1/messages` with an `Idempotency-Key`, std only. `Err` for anything that is not a
/// complete HTTP answer (refused, reset, timed out, cut short).
fn post_message(
    api: &Api,
    addr: SocketAddr,
    key: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(SEND_TIMEOUT))?;
    stream.set_write_timeout(Some(SEND_TIMEOUT))?;
    let req = format!(
        "POST /v1/messages HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Authorization: Bearer {}\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        api.token,
        body.len()
    );
    stream.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let broken = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "incomplete answer");
    let text = String::from_utf8(raw).map_err(|_| broken())?;
    let (head, rest) = text.split_once("\r\n\r\n").ok_or_else(broken)?;
    let status: u16 = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(broken)?;
    let head_lc = head.to_ascii_lowercase();
    let body = if head_lc.contains("transfer-encoding: chunked") {
        dechunk(rest).ok_or_else(broken)?
    } else {
        let len = head_lc
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .ok_or_else(broken)?;
        if rest.len() < len {
            return Err(broken());
        }
        rest[..len].to_string()
    };
    Ok((status, body))
}

/// A complete chunked body, or `None` when it was cut short.
fn dechunk(mut rest: &str) -> Option<String> {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return Some(body);
        }
        body.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// The sender thread: sends `from` → `to` until `stop`, each send retried with its key until it
/// is answered 201. Panics on any other answer (4xx/5xx are never expected here).
fn sender(
    api: Arc<Api>,
    from: &'static str,
    to: &'static str,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> SenderReport {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = SenderReport::default();
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let key = format!("drill-{from}-{n}");
        let body = json!({
            "from": from,
            "to": [to],
            "subject": format!("drill {key}"),
            "body": format!("{key} {:016x}", rng.gen::<u64>()),
        })
        .to_string();
        let mut attempts = 0u32;
        let first_try = Instant::now();
        let id = loop {
            attempts += 1;
            assert!(
                first_try.elapsed() < DAEMON_DOWN_LIMIT,
                "send {key}: no answer from {from}'s daemon for {DAEMON_DOWN_LIMIT:?}"
            );
            let Some(addr) = api.get() else {
                std::thread::sleep(POLL);
                continue;
            };
            match post_message(&api, addr, &key, &body) {
                Ok((201, text)) => {
                    let v: Value = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("send {key}: answer is not JSON ({e}): {text}"));
                    break v["id"]
                        .as_str()
                        .unwrap_or_else(|| panic!("send {key}: no id in {text}"))
                        .to_string();
                }
                // A rate limit (the local API's send class): nothing was done; ask again.
                Ok((429, _)) => std::thread::sleep(POLL),
                Ok((status, text)) => panic!("send {key} answered {status}: {text}"),
                Err(_) => std::thread::sleep(POLL),
            }
        };
        if attempts > 1 {
            report.retried += 1;
        }
        report.sent.push(Sent { key, id });
        std::thread::sleep(Duration::from_millis(rng.gen_range(PACE_MS)));
    }
    report
}

/// The three processes and the senders' view of the two daemons.
struct Drill {
    mesh: Mesh,
    apis: [Arc<Api>; 2],
    /// The failpoint each process was started with (relay, hosta, hostb).
    armed: [Option<String>; 3],
    log_dir: Option<PathBuf>,
}

impl Drill {
    fn host(&mut self, p: Proc) -> &mut Host {
        match p {
            Proc::A => &mut self.mesh.a,
            Proc::B => &mut self.mesh.b,
            Proc::Relay => unreachable!("the relay is not a host"),
        }
    }

    fn log(&mut self, p: Proc) -> String {
        match p {
            Proc::Relay => self.mesh.relay.proc().stderr(),
            _ => self.host(p).log(),
        }
    }

    /// SIGKILLs `p` (a daemon's API is marked down first); returns its log.
    fn kill(&mut self, p: Proc) -> String {
        match p {
            Proc::Relay => self.mesh.relay.kill(),
            Proc::A | Proc::B => {
                self.apis[p.index() - 1].set(None);
                self.host(p).kill()
            }
        }
    }

    /// Starts `p` again on its store, armed with `failpoint` when given.
    fn start(&mut self, p: Proc, failpoint: Option<String>) {
        match p {
            Proc::Relay => self.mesh.relay.launch(failpoint.as_deref()),
            Proc::A | Proc::B => {
                let host = self.host(p);
                host.start(failpoint.as_deref());
                let addr = host.daemon().addr;
                self.apis[p.index() - 1].set(Some(addr));
            }
        }
        self.armed[p.index()] = failpoint;
    }

    fn save_log(&self, name: &str, log: &str) {
        if let Some(dir) = &self.log_dir {
            std::fs::write(dir.join(format!("{name}.log")), log)
                .unwrap_or_else(|e| panic!("write {name}.log: {e}"));
        }
    }
}

/// `SELECT <text>, <int> …` into a map.
fn text_int_map(db: &Connection, sql: &str) -> HashMap<String, i64> {
    let mut st = db.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows")
}

fn count(db: &Connection, sql: &str) -> i64 {
    db.query_row(sql, [], |r| r.get(0))
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Whether the drill is quiet: each acknowledged message stored at its receiver, no pending
/// outbox row or delivery receipt on either host, the relay queue empty.
fn quiet(mesh: &Mesh, to_b: &[Sent], to_a: &[Sent]) -> bool {
    let stored = |host: &Host, sent: &[Sent]| {
        let ids: HashSet<String> = text_int_map(&host.db(), "SELECT id, 1 FROM messages")
            .into_keys()
            .collect();
        sent.iter().all(|s| ids.contains(&s.id))
    };
    let idle = |host: &Host| {
        let db = host.db();
        count(
            &db,
            "SELECT COUNT(*) FROM outbox WHERE state IN ('pending', 'repush')",
        ) == 0
            && count(&db, "SELECT COUNT(*) FROM receipt_outbox") == 0
    };
    stored(&mesh.b, to_b)
        && stored(&mesh.a, to_a)
        && idle(&mesh.a)
        && idle(&mesh.b)
        && count(&mesh.relay.db(), "SELECT COUNT(*) FROM items") == 0
}

/// The latest `next_at` (wall ms) of a pending outbox row or receipt on `host`.
fn latest_retry(host: &Host) -> i64 {
    let db = host.db();
    count(
        &db,
        "SELECT MAX(COALESCE((SELECT MAX(next_at) FROM outbox WHERE state IN ('pending', 'repush')), 0),
                    COALESCE((SELECT MAX(next_at) FROM receipt_outbox), 0))",
    )
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The relay's `dedup` rows: `(item_id, target) → (seq, accepted_at)`.
type Dedup = HashMap<(String, String), (i64, i64)>;

/// The relay-facing columns of a sender's outbox row.
#[derive(Debug)]
struct OutboxRow {
    id: String,
    state: String,
    seq: Option<i64>,
    at: Option<i64>,
    epoch: Option<String>,
}

/// Outcome of the checks for one direction.
#[derive(Debug, Default)]
struct Tally {
    lost: Vec<String>,
    duplicated: Vec<String>,
    problems: Vec<String>,
    /// Outbox rows a delivery receipt settled before the relay's accept was recorded.
    settled_without_accept: u64,
}

/// Checks the messages `sent` from `sender` to `receiver` against the relay's `dedup` rows and
/// its epoch `epoch`.
fn check_direction(
    sender: &Host,
    receiver: &Host,
    sent: &[Sent],
    dedup: &Dedup,
    epoch: &str,
    tally: &mut Tally,
) {
    let way = format!("{}→{}", sender.name, receiver.name);
    // One id per key, one key per id.
    let ids: HashSet<&str> = sent.iter().map(|s| s.id.as_str()).collect();
    if ids.len() != sent.len() {
        tally
            .problems
            .push(format!("{way}: {} keys share ids", sent.len() - ids.len()));
    }
    // At the receiver: each once, nothing else from this sender.
    let rdb = receiver.db();
    let stored = text_int_map(
        &rdb,
        &format!(
            "SELECT m.id, (SELECT COUNT(*) FROM deliveries d WHERE d.msg_id = m.id)
             FROM messages m WHERE m.origin = '{}'",
            sender.name
        ),
    );
    for s in sent {
        match stored.get(&s.id) {
            None => tally.lost.push(format!("{way} {} ({})", s.id, s.key)),
            Some(1) => {}
            Some(n) => tally
                .duplicated
                .push(format!("{way} {} delivered {n} times", s.id)),
        }
    }
    for id in stored.keys() {
        if !ids.contains(id.as_str()) {
            tally
                .duplicated
                .push(format!("{way} {id} stored but never acknowledged"));
        }
    }
    // At the sender: one message per acknowledged send.
    let sdb = sender.db();
    let own = count(&sdb, "SELECT COUNT(*) FROM messages WHERE origin = 'local'");
    if own != ids.len() as i64 {
        tally.duplicated.push(format!(
            "{way}: the sender stores {own} own messages for {} acknowledged sends",
            ids.len()
        ));
    }
    // The outbox rows: settled by their receipt, holding the relay's original accept.
    let mut st = sdb
        .prepare("SELECT msg_id, state, seq, accepted_at, epoch FROM outbox")
        .expect("prepare");
    let rows: Vec<OutboxRow> = st
        .query_map([], |r| {
            Ok(OutboxRow {
                id: r.get(0)?,
                state: r.get(1)?,
                seq: r.get(2)?,
                at: r.get(3)?,
                epoch: r.get(4)?,
            })
        })
        .expect("query outbox")
        .collect::<Result<_, _>>()
        .expect("outbox rows");
    if rows.len() != ids.len() {
        tally.problems.push(format!(
            "{way}: {} outbox rows for {} messages",
            rows.len(),
            ids.len()
        ));
    }
    for OutboxRow {
        id,
        state,
        seq,
        at,
        epoch: row_epoch,
    } in rows
    {
        let relay = dedup.get(&(id.clone(), receiver.pubkey.clone()));
        let Some(&(dseq, dat)) = relay else {
            tally
                .problems
                .push(format!("{way} {id}: no dedup row at the relay ({state})"));
            continue;
        };
        if state != "delivered" {
            tally.problems.push(format!(
                "{way} {id}: outbox row {state}, not settled by a receipt"
            ));
        }
        if state == "delivered" && seq.is_none() && at.is_none() {
            // The receipt came before the (re)push's answer was recorded (the sender died
            // with the answer unread): the row settled without an accept, which is no longer
            // needed (`outbox::settle_by_receipt`).
            tally.settled_without_accept += 1;
            continue;
        }
        if seq != Some(dseq) || at != Some(dat) || row_epoch.as_deref() != Some(epoch) {
            tally.problems.push(format!(
                "{way} {id}: accept seq {seq:?} at {at:?} epoch {row_epoch:?}, relay has seq {dseq} at {dat} epoch {epoch}"
            ));
        }
    }
}

#[test]
fn random_kills_lose_and_duplicate_nothing() {
    let started = Instant::now();
    let kills = env_u64("MBX_DRILL_KILLS").unwrap_or(DEFAULT_KILLS);
    let seed = env_u64("MBX_DRILL_SEED").unwrap_or_else(rand::random);
    let log_dir = std::env::var_os("MBX_DRILL_LOG_DIR").map(PathBuf::from);
    if let Some(dir) = &log_dir {
        std::fs::create_dir_all(dir).expect("create MBX_DRILL_LOG_DIR");
    }
    println!("drill: seed={seed:#x} kills={kills}");
    let mut rng = StdRng::seed_from_u64(seed);

    let mut mesh = Mesh::start(None);
    let epoch: String = mesh
        .relay
        .db()
        .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| r.get(0))
        .expect("meta.epoch");
    let api = |host: &mut Host| {
        Arc::new(Api {
            addr: Mutex::new(Some(host.daemon().addr)),
            token: host.home.token(),
        })
    };
    let apis = [api(&mut mesh.a), api(&mut mesh.b)];
    let stop = Arc::new(AtomicBool::new(false));
    let spawn = |api: &Arc<Api>, from: &'static str, to: &'static str, salt: u64| {
        let (api, stop) = (Arc::clone(api), Arc::clone(&stop));
        let seed = seed ^ salt;
        std::thread::spawn(move || sender(api, from, to, stop, seed))
    };
    let to_b = spawn(&apis[0], "alice", "bob@hostb", 0xA);
    let to_a = spawn(&apis[1], "bob", "alice@hosta", 0xB);
    let mut drill = Drill {
        mesh,
        apis,
        armed: [None, None, None],
        log_dir,
    };

    let kills_started = Instant::now();
    let mut by_proc = [0u64; 3];
    let mut at_failpoint = 0u64;
    for k in 1..=kills {
        let remaining = kills - k + 1;
        let armed: Vec<Proc> = Proc::ALL
            .into_iter()
            .filter(|p| drill.armed[p.index()].is_some())
            .collect();
        // Enough kills must remain to clear every armed process.
        let victim = if armed.len() as u64 >= remaining {
            armed[rng.gen_range(0..armed.len())]
        } else {
            Proc::ALL[rng.gen_range(0..3)]
        };
        let how = match drill.armed[victim.index()].clone() {
            Some(point) => {
                let name = point.split('@').next().unwrap_or_default().to_string();
                let wait = Duration::from_millis(rng.gen_range(FAILPOINT_WAIT_MS));
                let line = format!("FAILPOINT {name} reached");
                let until = Instant::now() + wait;
                let reached = loop {
                    if drill.log(victim).contains(&line) {
                        break true;
                    }
                    if Instant::now() >= until {
                        break false;
                    }
                    std::thread::sleep(POLL);
                };
                if reached {
                    at_failpoint += 1;
                    format!("at failpoint {point}")
                } else {
                    format!("after {} ms ({point} armed, not reached)", wait.as_millis())
                }
            }
            None => {
                let delay = rng.gen_range(KILL_DELAY_MS);
                std::thread::sleep(Duration::from_millis(delay));
                format!("after {delay} ms")
            }
        };
        let log = drill.kill(victim);
        drill.save_log(&format!("{k:05}-{}", victim.name()), &log);
        by_proc[victim.index()] += 1;
        let others_armed = armed.iter().filter(|p| **p != victim).count() as u64;
        let arm = others_armed < kills - k && rng.gen_bool(0.5);
        let failpoint = arm.then(|| {
            let points = victim.points();
            let name = points[rng.gen_range(0..points.len())];
            format!("{name}@{}", rng.gen_range(1..=3))
        });
        println!(
            "kill {k}/{kills}: {} {how}; restarted{}",
            victim.name(),
            failpoint
                .as_deref()
                .map(|f| format!(" armed with {f}"))
                .unwrap_or_default()
        );
        drill.start(victim, failpoint);
    }
    let kill_time = kills_started.elapsed();
    assert!(
        drill.armed.iter().all(Option::is_none),
        "every process runs unarmed at the end: {:?}",
        drill.armed
    );

    stop.store(true, Ordering::SeqCst);
    let to_b = to_b.join().expect("the hosta sender panicked");
    let to_a = to_a.join().expect("the hostb sender panicked");

    // Quiescence: everything in flight has arrived and settled.
    let quiet_started = Instant::now();
    let latest = latest_retry(&drill.mesh.a).max(latest_retry(&drill.mesh.b));
    let until_due = Duration::from_millis((latest - now_ms()).max(0) as u64);
    let deadline = Instant::now() + until_due + QUIESCENCE;
    let settled = loop {
        if quiet(&drill.mesh, &to_b.sent, &to_a.sent) {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
        std::thread::sleep(POLL);
    };
    let quiet_time = quiet_started.elapsed();
    for p in Proc::ALL {
        let log = drill.log(p);
        drill.save_log(&format!("final-{}", p.name()), &log);
    }

    let mesh = &drill.mesh;
    let dedup: Dedup = {
        let db = mesh.relay.db();
        let mut st = db
            .prepare("SELECT item_id, target_pubkey, seq, accepted_at FROM dedup")
            .expect("prepare");
        st.query_map([], |r| Ok(((r.get(0)?, r.get(1)?), (r.get(2)?, r.get(3)?))))
            .expect("query dedup")
            .collect::<Result<_, _>>()
            .expect("dedup rows")
    };
    let mut tally = Tally::default();
    check_direction(&mesh.a, &mesh.b, &to_b.sent, &dedup, &epoch, &mut tally);
    check_direction(&mesh.b, &mesh.a, &to_a.sent, &dedup, &epoch, &mut tally);
    let relay_db = mesh.relay.db();
    let seq_twice = count(
        &relay_db,
        "SELECT COUNT(*) FROM (SELECT 1 FROM dedup GROUP BY target_pubkey, seq HAVING COUNT(*) > 1)",
    );
    if seq_twice > 0 {
        tally
            .duplicated
            .push(format!("{seq_twice} seqs given to two items"));
    }
    let queued = count(&relay_db, "SELECT COUNT(*) FROM items");
    let quarantined = mesh.a.quarantined() + mesh.b.quarantined();
    let relay_epoch: String = relay_db
        .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| r.get(0))
        .expect("meta.epoch");
    let url = mesh.relay.url();
    for host in [&mesh.a, &mesh.b] {
        match host.position(&url) {
            Some(p) if p.epoch == epoch && p.acked_through == p.received_through => {}
            other => tally
                .problems
                .push(format!("{} position {other:?} (epoch {epoch})", host.name)),
        }
    }

    let elapsed = started.elapsed();
    let per_kill_ms = kill_time.as_millis() / u128::from(kills.max(1));
    println!(
        "drill: seed={seed:#x} kills={kills} (relay {}, hosta {}, hostb {}; {} at a failpoint) \
         messages={} (A→B {}, B→A {}; {} sends retried) lost={} duplicated={} queued={queued} \
         quarantined={quarantined} epoch_unchanged={} settled_before_accept={} elapsed={:.1}s ({per_kill_ms} ms per kill, \
         quiescence {:.1}s)",
        by_proc[0],
        by_proc[1],
        by_proc[2],
        at_failpoint,
        to_b.sent.len() + to_a.sent.len(),
        to_b.sent.len(),
        to_a.sent.len(),
        to_b.retried + to_a.retried,
        tally.lost.len(),
        tally.duplicated.len(),
        relay_epoch == epoch,
        tally.settled_without_accept,
        elapsed.as_secs_f64(),
        quiet_time.as_secs_f64(),
    );

    let show = |v: &[String]| v.iter().take(20).cloned().collect::<Vec<_>>().join("\n  ");
    assert!(
        tally.lost.is_empty(),
        "seed {seed:#x}: lost {}:\n  {}",
        tally.lost.len(),
        show(&tally.lost)
    );
    assert!(
        tally.duplicated.is_empty(),
        "seed {seed:#x}: duplicated {}:\n  {}",
        tally.duplicated.len(),
        show(&tally.duplicated)
    );
    assert!(
        settled,
        "seed {seed:#x}: not quiet {QUIESCENCE:?} after the last retry was due"
    );
    assert_eq!(queued, 0, "seed {seed:#x}: the relay queue drains");
    assert_eq!(quarantined, 0, "seed {seed:#x}: nothing in quarantine");
    assert_eq!(
        relay_epoch, epoch,
        "seed {seed:#x}: the epoch never changed"
    );
    assert!(
        tally.problems.is_empty(),
        "seed {seed:#x}: {} problems:\n  {}",
        tally.problems.len(),
        show(&tally.problems)
    );
    assert!(
        !to_b.sent.is_empty() && !to_a.sent.is_empty(),
        "both senders sent"
    );
}
