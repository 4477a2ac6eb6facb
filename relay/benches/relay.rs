//! Relay benchmarks (figures 1–3 of the benchmark report): durable accepts per second, pull
//! drain throughput and the latency of one pull page at two queue depths; and the protocol's
//! floor under figure 1 ([`floor`]: the per-item work no relay code can avoid, measured here).
//!
//! `cargo bench -p agentmbx-relay --bench relay -- <floor|accept|pull|page-latency|all>
//! [--runs N] [--quick]`
//!
//! The relay runs as a separate process: the release `agentmbx` binary (`MBX_BENCH_BIN`, default
//! `<target>/release/agentmbx`) as `relay serve` on 127.0.0.1, over a fresh store directory
//! (under `MBX_BENCH_DIR`, default the system temporary directory) whose `relay.toml` raises the
//! quotas and the per-sender rate limits. This process is the load generator: it enrols hosts
//! through the HTTP challenge flow, signs every request as a v2 hop and pushes sealed
//! envelopes as close to 1 KiB of wire as sealing allows ([`body_len_for_1k`]). Deep queues are
//! seeded into the store directly while the relay is stopped ([`seed`]). Commits are counted by
//! the relay (`GET /v2/relay/admin/stats`); CPU time comes from `/proc/<pid>/stat`.
//!
//! Output: per figure one line `BENCH {json}` on stdout (`id`, `label`, `unit`, `median`, `min`,
//! `max`, `runs`, `extra`); progress on stderr. Nothing here asserts a time: the binary exits
//! non-zero only on real errors (a refused item, a relay that died).
#![allow(clippy::unwrap_used, clippy::expect_used)] // A bench binary: a failure is a report.

#[path = "relay/seed.rs"]
mod seed;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::hop;
use agentmbx_protocol::keys::{EncKey, HostKey};
use agentmbx_protocol::wire::PullResponse;
use agentmbx_protocol::{b64, records, seal, ulid};

/// Admin token of the bench relays (loopback only, thrown away with the store).
const ADMIN: &str = "bench-admin-token-0123456789abcdef";

/// Wire bytes each sealed item aims at.
const ITEM_BYTES: usize = 1024;

/// Concurrent senders of figure 1 (distinct enrolled host keys).
const SENDERS: usize = 50;

/// Targets the senders of figure 1 push to (round robin), so no queue grows deep.
const TARGETS: usize = 50;

type Res<T> = Result<T, String>;

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut scenario = None;
    let mut runs = 5usize;
    let mut quick = false;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--quick" => quick = true,
            "--runs" => {
                i += 1;
                runs = args
                    .get(i)
                    .and_then(|v| v.parse().ok())
                    .filter(|n| *n > 0)
                    .unwrap_or_else(|| fail("--runs needs a positive number"));
            }
            // `cargo bench` passes `--bench`; other harness flags are ignored too.
            a if a.starts_with("--") => {}
            a => scenario = Some(a.to_owned()),
        }
        i += 1;
    }
    if quick {
        runs = 1;
    }
    let scenario = scenario.unwrap_or_else(|| "all".to_owned());
    let sizes = if quick { Sizes::QUICK } else { Sizes::FULL };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let result = rt.block_on(async move {
        let ctx = Ctx::new()?;
        match scenario.as_str() {
            "accept" => accept(&ctx, &sizes, runs).await,
            "floor" => floor(&ctx, &sizes, runs).await,
            "pull" => pull_drain(&ctx, &sizes, runs).await,
            "page-latency" => page_latency(&ctx, &sizes, runs).await,
            "all" => {
                floor(&ctx, &sizes, runs).await?;
                accept(&ctx, &sizes, runs).await?;
                pull_drain(&ctx, &sizes, runs).await?;
                page_latency(&ctx, &sizes, runs).await
            }
            other => Err(format!(
                "unknown scenario {other:?}: floor, accept, pull, page-latency or all"
            )),
        }
    });
    if let Err(e) = result {
        fail(&e);
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("bench relay: error: {msg}");
    std::process::exit(1)
}

/// Workload sizes.
struct Sizes {
    /// Requests per sender, one item each (figure 1).
    batch1_requests: usize,
    /// Requests per sender, 20 items each (figure 1).
    batch20_requests: usize,
    /// Queue drained per run (figure 2).
    drain_items: usize,
    /// Shallow and deep queue (figure 3).
    page_small: usize,
    page_deep: usize,
    /// Pulls of the first page per run and depth (figure 3).
    page_pulls: usize,
}

impl Sizes {
    const FULL: Sizes = Sizes {
        batch1_requests: 200,
        batch20_requests: 50,
        drain_items: 100_000,
        page_small: 1_000,
        page_deep: 1_000_000,
        page_pulls: 200,
    };
    const QUICK: Sizes = Sizes {
        batch1_requests: 10,
        batch20_requests: 4,
        drain_items: 5_000,
        page_small: 1_000,
        page_deep: 20_000,
        page_pulls: 20,
    };
}

/// Where the binary and the store directories are.
struct Ctx {
    bin: PathBuf,
    root: PathBuf,
    http: reqwest::Client,
}

impl Ctx {
    fn new() -> Res<Ctx> {
        let bin = match std::env::var_os("MBX_BENCH_BIN") {
            Some(b) => PathBuf::from(b),
            None => {
                // target/release/deps/relay-<hash> → target/release/agentmbx
                let exe = std::env::current_exe().map_err(|e| e.to_string())?;
                let release = exe
                    .parent()
                    .and_then(Path::parent)
                    .ok_or("cannot find the target directory")?;
                release.join("agentmbx")
            }
        };
        if !bin.is_file() {
            return Err(format!(
                "{} not found: build it with `cargo build --release -p agentmbx` or set MBX_BENCH_BIN",
                bin.display()
            ));
        }
        let base = std::env::var_os("MBX_BENCH_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        std::fs::create_dir_all(&base).map_err(|e| e.to_string())?;
        let root = base.join(format!("mbx-relay-bench-{}", std::process::id()));
        std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(256)
            .timeout(Duration::from_secs(120))
            .build()
            .map_err(|e| e.to_string())?;
        eprintln!(
            "bench relay: binary {}, stores under {}",
            bin.display(),
            root.display()
        );
        Ok(Ctx { bin, root, http })
    }

    /// A fresh, empty store directory.
    fn store_dir(&self, name: &str) -> Res<PathBuf> {
        let dir = self.root.join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| e.to_string())?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("relay.toml"), RELAY_TOML).map_err(|e| e.to_string())?;
        Ok(dir)
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Quotas and rate limits raised for a benchmark (the published defaults would refuse it);
/// everything else is the default.
const RELAY_TOML: &str = "\
[limits]
max_batch = 1000
max_queue_items = 100000000
max_queue_bytes = 1000000000000
max_sender_items = 100000000
max_sender_bytes = 1000000000000
max_owner_items = 100000000
max_owner_bytes = 1000000000000
[rate]
enrol_per_min = 1000000
info_per_min = 1000000
push_per_min = 1000000
";

// ---- the relay process ---------------------------------------------------------------------

/// A `relay serve` child process.
struct RelayProc {
    child: Child,
    base: String,
    pid: u32,
}

impl RelayProc {
    /// Starts the relay over `dir` with `key` on a free loopback port and waits until it
    /// answers `GET /v2/relay/info`.
    async fn start(ctx: &Ctx, dir: &Path, key: &HostKey) -> Res<RelayProc> {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            l.local_addr().map_err(|e| e.to_string())?.port()
        };
        let log = std::fs::File::create(dir.join("relay.out")).map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(&ctx.bin)
            .args(["relay", "serve", "--bind", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .arg("--store-dir")
            .arg(dir)
            .env("MBX_RELAY_KEY", key.seed_b64_secret())
            .env("MBX_RELAY_ADMIN_TOKEN", ADMIN)
            .env("MBX_LOG", "warn")
            .env_remove("PORT")
            .env_remove("MBX_RELAY_DIR")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", ctx.bin.display()))?;
        let pid = child.id();
        let mut relay = RelayProc {
            child,
            base: format!("http://127.0.0.1:{port}"),
            pid,
        };
        let until = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(Some(status)) = relay.child.try_wait() {
                return Err(format!(
                    "the relay exited at start ({status}): {}",
                    tail(&dir.join("relay.out"))
                ));
            }
            let ok = ctx
                .http
                .get(format!("{}/v2/relay/info", relay.base))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(relay);
            }
            if Instant::now() > until {
                let _ = relay.child.kill();
                return Err("the relay did not answer within 120 s".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Fails when the relay process has exited.
    fn check_alive(&mut self) -> Res<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!("the relay died ({status})")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The relay's CPU time so far (user + system, µs).
    fn cpu_us(&self) -> Res<f64> {
        proc_cpu_us(&format!("/proc/{}/stat", self.pid))
    }

    /// CPU time (user + system, µs) of the relay's store writer thread (the one thread that
    /// runs every SQLite write and commit; named `relay-store-writer`, which Linux shows cut to
    /// 15 bytes in `/proc/<pid>/task/<tid>/comm`).
    fn writer_cpu_us(&self) -> Res<f64> {
        let tasks = format!("/proc/{}/task", self.pid);
        for entry in std::fs::read_dir(&tasks).map_err(|e| format!("{tasks}: {e}"))? {
            let dir = entry.map_err(|e| e.to_string())?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            if "relay-store-writer".starts_with(comm.trim_end()) && !comm.trim_end().is_empty() {
                return proc_cpu_us(&dir.join("stat").to_string_lossy());
            }
        }
        Err(format!("no relay-store-writer thread under {tasks}"))
    }

    /// The store writer's counters.
    async fn stats(&self, ctx: &Ctx) -> Res<Value> {
        let r = ctx
            .http
            .get(format!("{}/v2/relay/admin/stats", self.base))
            .bearer_auth(ADMIN)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return Err(
                "GET /v2/relay/admin/stats answered 404: the relay binary predates it; rebuild it \
                 from this checkout (`cargo build --release -p agentmbx`)"
                    .into(),
            );
        }
        if !r.status().is_success() {
            return Err(format!("admin stats answered {}", r.status()));
        }
        r.json().await.map_err(|e| e.to_string())
    }

    /// SIGTERM, then waits for a clean exit (status 0).
    async fn stop(mut self) -> Res<()> {
        self.check_alive()?;
        // SIGTERM through kill(1): the relay's clean stop (the workspace forbids `unsafe`).
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .map_err(|e| format!("kill: {e}"))?;
        if !sent.success() {
            return Err(format!("kill -TERM {} failed", self.pid));
        }
        let until = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("the relay stopped with {status}"))
                };
            }
            if Instant::now() > until {
                let _ = self.child.kill();
                return Err("the relay did not stop within 120 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RelayProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn tail(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let start = bytes.len().saturating_sub(2000);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// utime + stime of `/proc/<pid>/stat`, in µs.
fn proc_cpu_us(stat_path: &str) -> Res<f64> {
    let text = std::fs::read_to_string(stat_path).map_err(|e| format!("{stat_path}: {e}"))?;
    let after = text
        .rsplit_once(')')
        .map(|(_, a)| a)
        .ok_or("bad /proc stat")?;
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat(5); `after` starts at field 3.
    let ticks: f64 = f
        .get(11)
        .zip(f.get(12))
        .and_then(|(u, s)| Some(u.parse::<f64>().ok()? + s.parse::<f64>().ok()?))
        .ok_or("bad /proc stat fields")?;
    Ok(ticks * 1e6 / clock_ticks_per_s())
}

/// `getconf CLK_TCK` (the unit of `/proc/<pid>/stat` times), read once; 100 when unknown.
fn clock_ticks_per_s() -> f64 {
    static HZ: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *HZ.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .filter(|hz: &f64| *hz > 0.0)
            .unwrap_or(100.0)
    })
}

fn self_cpu_us() -> Res<f64> {
    proc_cpu_us("/proc/self/stat")
}

// ---- hosts, envelopes, hops ----------------------------------------------------------------

/// A host the bench plays: its name and keys.
#[derive(Debug)]
pub struct Host {
    /// Host name.
    pub name: String,
    /// Ed25519 host key.
    pub key: HostKey,
    /// X25519 enc key.
    pub enc: EncKey,
}

impl Host {
    /// A fresh host.
    pub fn new(name: &str) -> Host {
        Host {
            name: name.to_owned(),
            key: HostKey::generate(),
            enc: EncKey::generate(),
        }
    }

    /// The host key, standard base64.
    pub fn pubkey(&self) -> String {
        self.key.public().to_b64()
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A sealed envelope from `from` for `to` whose body has `body_len` bytes: `(id, wire)`.
pub fn sealed(
    from: &Host,
    to: &Host,
    body_len: usize,
    ids: &mut ulid::Generator,
) -> (String, Vec<u8>) {
    let now = now_ms();
    let draft = Draft {
        from: format!("agent@{}", from.name),
        to: vec![format!("agent@{}", to.name)],
        subject: "bench".into(),
        body: "x".repeat(body_len),
        ..Draft::default()
    };
    let mut env = envelope::build(&draft, ids.next(now), now).expect("build envelope");
    env.sign(&from.name, &from.key).expect("sign envelope");
    let s =
        seal::seal_envelope(&env, &to.enc.public(), &from.name, &from.key).expect("seal envelope");
    (s.id.clone(), s.wire_json().into_bytes())
}

/// The body length whose sealed wire is closest to [`ITEM_BYTES`]: 0 when even an empty body
/// seals to more (headers, host signature, ephemeral key and nonce take about 1.5 KiB), so the
/// items are then the smallest sealed envelopes.
pub fn body_len_for_1k() -> usize {
    let (a, b) = (Host::new("sender-000"), Host::new("target-000"));
    let mut ids = ulid::Generator::new();
    let base = sealed(&a, &b, 0, &mut ids).1.len();
    let mut len = ITEM_BYTES.saturating_sub(base);
    for _ in 0..8 {
        let got = sealed(&a, &b, len, &mut ids).1.len();
        if got == ITEM_BYTES {
            break;
        }
        len = (len as i64 + (ITEM_BYTES as i64 - got as i64)).max(0) as usize;
    }
    len
}

/// Sends a v2 hop signed by `host` now; returns (status, body).
async fn hop_request(
    http: &reqwest::Client,
    base: &str,
    host: &Host,
    method: &str,
    target: &str,
    body: String,
) -> Res<(u16, String)> {
    let h = hop::sign_relay_hop(&host.key, &host.name, method, target, now_ms(), &body);
    let m = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
    let mut req = http
        .request(m, format!("{base}{target}"))
        .header("content-type", "application/json");
    for (k, v) in h.pairs() {
        req = req.header(k, v);
    }
    let res = req.body(body).send().await.map_err(|e| e.to_string())?;
    let status = res.status().as_u16();
    let text = res.text().await.map_err(|e| e.to_string())?;
    Ok((status, text))
}

/// Enrols `host` through the HTTP challenge flow.
async fn enrol(ctx: &Ctx, base: &str, host: &Host) -> Res<()> {
    let pk = host.pubkey();
    let r = ctx
        .http
        .post(format!("{base}/v1/relay/challenge"))
        .json(&json!({"host": host.name, "pubkey": pk}))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    let challenge = v["challenge"]
        .as_str()
        .ok_or_else(|| format!("no challenge: {v}"))?;
    let sig = host
        .key
        .sign(records::enrol_canonical(challenge, &host.name, &pk, "").as_bytes());
    let r = ctx
        .http
        .post(format!("{base}/v1/relay/enrol"))
        .json(&json!({"host": host.name, "pubkey": pk, "owner_fp": "", "sig": sig}))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    if v != json!({"ok": true}) {
        return Err(format!("enrolment of {} refused: {v}", host.name));
    }
    Ok(())
}

// ---- statistics and output -----------------------------------------------------------------

fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0)
}

/// Nearest-rank percentile of `v` (unsorted).
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if p == 50.0 && s.len().is_multiple_of(2) {
        return (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0;
    }
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

fn round(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

/// Prints one `BENCH {json}` line: the median, min and max of `values` over the runs, and the
/// median of each extra figure.
fn report(
    id: &str,
    label: &str,
    unit: &str,
    values: &[f64],
    extras: &[(&str, Vec<f64>)],
    fixed: Value,
) {
    let mut extra = serde_json::Map::new();
    for (k, v) in extras {
        extra.insert((*k).to_owned(), json!(round(median(v), 3)));
    }
    if let Value::Object(m) = fixed {
        extra.extend(m);
    }
    let line = json!({
        "id": id,
        "label": label,
        "unit": unit,
        "median": round(median(values), 3),
        "min": round(values.iter().copied().fold(f64::INFINITY, f64::min), 3),
        "max": round(values.iter().copied().fold(f64::NEG_INFINITY, f64::max), 3),
        "runs": values.len(),
        "extra": extra,
    });
    println!("BENCH {line}");
}

// ---- the protocol's floor under figure 1 ----------------------------------------------------

/// Items the store-rows floor writes per run, and per transaction (about what the relay's group
/// commit reaches at batch 20).
const FLOOR_ROWS_ITEMS: usize = 40_000;
const FLOOR_ROWS_PER_TX: usize = 400;

/// The work every accepted item costs whatever the relay's code, measured on this machine on
/// one thread: the accept statement's Ed25519 signature (one per item, `wire.md` §2.8), the
/// hop's Ed25519 verification (one per request, §2.2), the SHA-256 of the wire bytes, and the
/// SQLite rows the spec's store layout writes for an item (`wire.md` §3.3: the item row with its
/// wire, its dedup row and the target's seq; the spec's indexes only, none of this relay's own
/// counters, in WAL with `synchronous=FULL` and the relay writer's 16 MiB page cache,
/// [`FLOOR_ROWS_PER_TX`] items per transaction).
/// From these: the CPU floor per item at 20 and at 1 item per request, and the accepts per
/// second that floor allows on this machine's cores if nothing else (HTTP, JSON, base64, the
/// load generator, the kernel's network path) cost anything.
async fn floor(ctx: &Ctx, sizes: &Sizes, runs: usize) -> Res<()> {
    let rows_items = if sizes.drain_items < 100_000 {
        FLOOR_ROWS_ITEMS / 10
    } else {
        FLOOR_ROWS_ITEMS
    };
    let key = HostKey::generate();
    let statement = records::AcceptStatement {
        v: 1,
        kind: "relay-accept".to_owned(),
        relay_pubkey: key.public().to_b64(),
        epoch: "e-0123456789abcdef".to_owned(),
        sender_pubkey: HostKey::generate().public().to_b64(),
        item_id: ulid::Generator::new().next(0),
        targets: vec![records::AcceptTarget {
            host_pubkey: HostKey::generate().public().to_b64(),
            seq: 1_764_500_000_000_123,
            wire_hash: "ab".repeat(32),
        }],
        at: "2026-11-30T12:00:00.123Z".to_owned(),
    };
    let signed = statement.canonical();
    let wire = vec![b'x'; 1547];
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let (mut sign, mut verify, mut sha, mut rows, mut rows_wall) =
        (vec![], vec![], vec![], vec![], vec![]);
    for run in 0..runs {
        let per_op = |n: usize, f: &mut dyn FnMut()| {
            let t0 = Instant::now();
            for _ in 0..n {
                f();
            }
            t0.elapsed().as_secs_f64() * 1e6 / n as f64
        };
        let mut sig = String::new();
        sign.push(per_op(4_000, &mut || {
            sig = key.sign(std::hint::black_box(signed.as_bytes()));
        }));
        let public = key.public();
        verify.push(per_op(2_000, &mut || {
            assert!(public.verify(std::hint::black_box(signed.as_bytes()), &sig));
        }));
        sha.push(per_op(20_000, &mut || {
            std::hint::black_box(agentmbx_protocol::hash::sha256_hex(std::hint::black_box(
                &wire,
            )));
        }));
        let dir = ctx.store_dir(&format!("floor-{run}"))?;
        let (cpu, wall) = spec_rows(&dir.join("floor.db"), rows_items, &wire)?;
        rows.push(cpu);
        rows_wall.push(wall);
        let _ = std::fs::remove_dir_all(&dir);
    }
    report(
        "floor_ed25519_sign",
        "Ed25519 signature of one accept statement (one per accepted item)",
        "µs",
        &sign,
        &[],
        json!({"bytes_signed": signed.len()}),
    );
    report(
        "floor_ed25519_verify",
        "Ed25519 verification of one hop (one per push request)",
        "µs",
        &verify,
        &[],
        json!({}),
    );
    report(
        "floor_sha256_wire",
        "SHA-256 of one 1547 B wire (one per item target)",
        "µs",
        &sha,
        &[],
        json!({}),
    );
    report(
        "floor_store_rows",
        "SQLite rows of the spec's store layout per item (item + dedup + seq), CPU of one thread",
        "µs/item",
        &rows,
        &[("wall_us_per_item", rows_wall)],
        json!({"items_per_run": rows_items, "items_per_transaction": FLOOR_ROWS_PER_TX,
               "journal": "WAL, synchronous=FULL"}),
    );
    let (http_relay, http_gen) = http_floor(ctx, sizes, runs).await?;
    let http: Vec<f64> = http_relay
        .iter()
        .zip(&http_gen)
        .map(|(r, g)| r + g)
        .collect();
    report(
        "floor_http_request",
        "one HTTP/1.1 request and answer on loopback, the relay's cheapest route (relay + load generator CPU)",
        "µs",
        &http,
        &[("relay_us", http_relay), ("loadgen_us", http_gen)],
        json!({"clients": SENDERS, "route": "GET /v2/relay/info (no hop; one store read, the epoch)"}),
    );
    for (batch, id) in [(20.0, "floor_batch20"), (1.0, "floor_batch1")] {
        let per_item: Vec<f64> = (0..runs)
            .map(|i| sign[i] + verify[i] / batch + sha[i] + rows[i])
            .collect();
        let ceiling: Vec<f64> = per_item.iter().map(|us| cores * 1e6 / us).collect();
        let with_http: Vec<f64> = per_item
            .iter()
            .zip(&http)
            .map(|(us, h)| cores * 1e6 / (us + h / batch))
            .collect();
        report(
            id,
            &format!(
                "protocol floor per item at {batch} item(s)/request (sign + verify/{batch} + SHA-256 + rows)"
            ),
            "µs/item",
            &per_item,
            &[
                ("ceiling_items_per_s", ceiling),
                ("ceiling_with_http_items_per_s", with_http),
            ],
            json!({"cores": cores}),
        );
    }
    Ok(())
}

/// CPU (relay + this load generator, µs) of one HTTP request and its answer with nothing behind
/// it but the relay's cheapest route: [`SENDERS`] concurrent clients on the same keep-alive
/// client as figure 1, each sending `GET /v2/relay/info` (no hop to verify; one store read) in a
/// closed loop. Per run: `(relay µs, load generator µs)` per request.
async fn http_floor(ctx: &Ctx, sizes: &Sizes, runs: usize) -> Res<(Vec<f64>, Vec<f64>)> {
    let per_client = if sizes.drain_items < 100_000 { 40 } else { 400 };
    let mut out = (Vec::new(), Vec::new());
    for run in 0..runs {
        let dir = ctx.store_dir(&format!("floor-http-{run}"))?;
        let mut relay = RelayProc::start(ctx, &dir, &HostKey::generate()).await?;
        let info_url = format!("{}/v2/relay/info", relay.base);
        let once = |n: usize| {
            let tasks: Vec<_> = (0..SENDERS)
                .map(|_| {
                    let (http, url) = (ctx.http.clone(), info_url.clone());
                    tokio::spawn(async move {
                        for _ in 0..n {
                            let r = http.get(&url).send().await.map_err(|e| e.to_string())?;
                            if !r.status().is_success() {
                                return Err(format!("relay info answered {}", r.status()));
                            }
                            r.bytes().await.map_err(|e| e.to_string())?;
                        }
                        Ok::<(), String>(())
                    })
                })
                .collect();
            async move {
                for t in tasks {
                    t.await.map_err(|e| e.to_string())??;
                }
                Ok::<(), String>(())
            }
        };
        once(2).await?;
        let (rcpu0, gcpu0) = (relay.cpu_us()?, self_cpu_us()?);
        once(per_client).await?;
        let (rcpu1, gcpu1) = (relay.cpu_us()?, self_cpu_us()?);
        relay.check_alive()?;
        let n = (SENDERS * per_client) as f64;
        out.0.push((rcpu1 - rcpu0) / n);
        out.1.push((gcpu1 - gcpu0) / n);
        relay.stop().await?;
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

/// Writes `items` items the way the spec's store layout does (`wire.md` §3.3), in transactions
/// of [`FLOOR_ROWS_PER_TX`], on this thread; `(CPU µs, wall µs)` per item.
fn spec_rows(path: &Path, items: usize, wire: &[u8]) -> Res<(f64, f64)> {
    let e = |e: rusqlite::Error| e.to_string();
    let c = rusqlite::Connection::open(path).map_err(e)?;
    c.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA cache_size = -16384;
         PRAGMA temp_store = MEMORY;
         CREATE TABLE items (target_pubkey TEXT NOT NULL, seq INTEGER NOT NULL,
           kind TEXT NOT NULL, item_id TEXT NOT NULL, sender_pubkey TEXT NOT NULL,
           sender_host TEXT NOT NULL, wire BLOB NOT NULL, wire_hash TEXT NOT NULL,
           bytes INTEGER NOT NULL, accepted_at INTEGER NOT NULL, expires_at INTEGER,
           PRIMARY KEY (target_pubkey, seq));
         CREATE INDEX items_expiry ON items(expires_at);
         CREATE INDEX items_sender ON items(sender_pubkey, target_pubkey);
         CREATE TABLE dedup (sender_pubkey TEXT NOT NULL, item_id TEXT NOT NULL,
           target_pubkey TEXT NOT NULL, wire_hash TEXT NOT NULL, seq INTEGER NOT NULL,
           accepted_at INTEGER NOT NULL, PRIMARY KEY (sender_pubkey, item_id, target_pubkey));
         CREATE INDEX dedup_age ON dedup(accepted_at);
         CREATE TABLE seqs (target_pubkey TEXT PRIMARY KEY NOT NULL, next_seq INTEGER NOT NULL);",
    )
    .map_err(e)?;
    let senders: Vec<String> = (0..SENDERS)
        .map(|_| HostKey::generate().public().to_b64())
        .collect();
    let targets: Vec<String> = (0..TARGETS)
        .map(|_| HostKey::generate().public().to_b64())
        .collect();
    let mut ids = ulid::Generator::new();
    let hash = "cd".repeat(32);
    let (cpu0, t0) = (proc_cpu_us("/proc/thread-self/stat")?, Instant::now());
    let mut n = 0usize;
    while n < items {
        c.execute_batch("BEGIN IMMEDIATE").map_err(e)?;
        for _ in 0..FLOOR_ROWS_PER_TX.min(items - n) {
            let (sender, target) = (&senders[n % SENDERS], &targets[(n / SENDERS) % TARGETS]);
            let now = 1_764_500_000_000i64 + n as i64;
            let seq: i64 = c
                .prepare_cached(
                    "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, 1)
                     ON CONFLICT (target_pubkey) DO UPDATE SET next_seq = next_seq + 1
                     RETURNING next_seq",
                )
                .map_err(e)?
                .query_row([target], |r| r.get(0))
                .map_err(e)?;
            let id = ids.next(now);
            c.prepare_cached(
                "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                                    wire, wire_hash, bytes, accepted_at, expires_at)
                 VALUES (?1, ?2, 'envelope', ?3, ?4, 'sender', ?5, ?6, ?7, ?8, ?9)",
            )
            .map_err(e)?
            .execute(rusqlite::params![
                target,
                seq,
                id,
                sender,
                wire,
                hash,
                wire.len() as i64,
                now,
                now + 14 * 86_400_000
            ])
            .map_err(e)?;
            c.prepare_cached(
                "INSERT INTO dedup (sender_pubkey, item_id, target_pubkey, wire_hash, seq,
                                    accepted_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .map_err(e)?
            .execute(rusqlite::params![sender, id, target, hash, seq, now])
            .map_err(e)?;
            n += 1;
        }
        c.execute_batch("COMMIT").map_err(e)?;
    }
    let (cpu1, wall) = (proc_cpu_us("/proc/thread-self/stat")?, t0.elapsed());
    Ok((
        (cpu1 - cpu0) / items as f64,
        wall.as_secs_f64() * 1e6 / items as f64,
    ))
}

// ---- figure 1: durable accepts -------------------------------------------------------------

/// One request body per entry; `items` counts the items in it. `hop` is its signed hop
/// headers, made by [`sign_all`] just before the timed run (a hop is good for ±300 s), so the
/// load generator spends the timed run on HTTP, as `redis-benchmark` does.
struct Request {
    body: String,
    items: usize,
    hop: Vec<(&'static str, String)>,
}

/// Signs the hop of every request (on two threads).
fn sign_all(senders: &[Arc<Host>], work: &mut [Vec<Request>]) {
    std::thread::scope(|sc| {
        let (even, odd): (Vec<_>, Vec<_>) = senders
            .iter()
            .zip(work.iter_mut())
            .enumerate()
            .partition(|(i, _)| i % 2 == 0);
        for part in [even, odd] {
            sc.spawn(move || {
                for (_, (host, reqs)) in part {
                    for r in reqs.iter_mut() {
                        let h = hop::sign_relay_hop(
                            &host.key,
                            &host.name,
                            "POST",
                            "/v2/relay/items",
                            now_ms(),
                            &r.body,
                        );
                        r.hop = h.pairs();
                    }
                }
            });
        }
    });
}

/// The part of a push answer the load generator checks: every item's status.
#[derive(serde::Deserialize)]
struct PushStatuses {
    results: Vec<ItemStatusOnly>,
}

#[derive(serde::Deserialize)]
struct ItemStatusOnly {
    item_id: String,
    status: String,
}

/// Builds `requests` push bodies of `batch` fresh sealed items for sender `s` (targets round
/// robin), on a blocking thread.
fn build_requests(
    s: usize,
    sender: &Host,
    targets: &[Host],
    requests: usize,
    batch: usize,
    body_len: usize,
) -> Vec<Request> {
    let mut ids = ulid::Generator::new();
    let mut k = s;
    (0..requests)
        .map(|_| {
            let items: Vec<Value> = (0..batch)
                .map(|_| {
                    let to = &targets[k % targets.len()];
                    k += 1;
                    let (id, wire) = sealed(sender, to, body_len, &mut ids);
                    json!({"kind": "envelope", "item_id": id,
                           "targets": [{"host_pubkey": to.pubkey(), "wire_b64": b64::encode(&wire)}]})
                })
                .collect();
            Request {
                body: json!({ "items": items }).to_string(),
                items: batch,
                hop: Vec::new(),
            }
        })
        .collect()
}

/// Sends each of `reqs` in turn with its pre-signed hop; every item must come back `accepted`.
async fn send_all(http: reqwest::Client, base: String, reqs: Vec<Request>) -> Res<usize> {
    let mut n = 0;
    let url = format!("{base}/v2/relay/items");
    for r in reqs {
        let mut req = http.post(&url).header("content-type", "application/json");
        for (k, v) in r.hop {
            req = req.header(k, v);
        }
        let res = req.body(r.body).send().await.map_err(|e| e.to_string())?;
        let status = res.status().as_u16();
        let text = res.bytes().await.map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(format!(
                "push answered {status}: {}",
                String::from_utf8_lossy(&text)
            ));
        }
        let resp: PushStatuses =
            serde_json::from_slice(&text).map_err(|e| format!("push answer: {e}"))?;
        if resp.results.len() != r.items {
            return Err(format!(
                "{} results for {} items",
                resp.results.len(),
                r.items
            ));
        }
        if let Some(bad) = resp.results.iter().find(|x| x.status != "accepted") {
            return Err(format!("item {} answered {}", bad.item_id, bad.status));
        }
        n += r.items;
    }
    Ok(n)
}

/// Builds requests for every sender on two threads.
fn build_all(
    senders: &[Arc<Host>],
    targets: &Arc<Vec<Host>>,
    requests: usize,
    batch: usize,
    body_len: usize,
) -> Vec<Vec<Request>> {
    let halves: Vec<Vec<(usize, Vec<Request>)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|part| {
                sc.spawn(move || {
                    (0..senders.len())
                        .filter(|s| s % 2 == part)
                        .map(|s| {
                            (
                                s,
                                build_requests(s, &senders[s], targets, requests, batch, body_len),
                            )
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("builder thread"))
            .collect()
    });
    let mut all: Vec<(usize, Vec<Request>)> = halves.into_iter().flatten().collect();
    all.sort_by_key(|(s, _)| *s);
    all.into_iter().map(|(_, r)| r).collect()
}

async fn accept(ctx: &Ctx, sizes: &Sizes, runs: usize) -> Res<()> {
    let body_len = body_len_for_1k();
    for (batch, requests, id) in [
        (1usize, sizes.batch1_requests, "relay_accept_batch1"),
        (20, sizes.batch20_requests, "relay_accept_batch20"),
    ] {
        let mut rates = Vec::new();
        let (mut per_fsync, mut reqs_per_commit, mut relay_cpu, mut gen_cpu, mut secs) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut writer_cpu = vec![];
        let mut wire_bytes = 0usize;
        for run in 0..runs {
            let dir = ctx.store_dir(&format!("accept-{batch}-{run}"))?;
            let key = HostKey::generate();
            let mut relay = RelayProc::start(ctx, &dir, &key).await?;
            let senders: Vec<Arc<Host>> = (0..SENDERS)
                .map(|i| Arc::new(Host::new(&format!("sender-{i:03}"))))
                .collect();
            let targets: Arc<Vec<Host>> = Arc::new(
                (0..TARGETS)
                    .map(|i| Host::new(&format!("target-{i:03}")))
                    .collect(),
            );
            for h in senders.iter().map(|s| s.as_ref()).chain(targets.iter()) {
                enrol(ctx, &relay.base, h).await?;
            }
            eprintln!(
                "bench relay: {id} run {}/{runs}: building {} sealed items…",
                run + 1,
                SENDERS * (requests + 1) * batch
            );
            let (s2, t2) = (senders.clone(), targets.clone());
            let warm = tokio::task::spawn_blocking(move || build_all(&s2, &t2, 1, batch, body_len))
                .await
                .map_err(|e| e.to_string())?;
            let (s2, t2) = (senders.clone(), targets.clone());
            let work =
                tokio::task::spawn_blocking(move || build_all(&s2, &t2, requests, batch, body_len))
                    .await
                    .map_err(|e| e.to_string())?;
            wire_bytes = {
                let v: Value = serde_json::from_str(&work[0][0].body).map_err(|e| e.to_string())?;
                let w = v["items"][0]["targets"][0]["wire_b64"]
                    .as_str()
                    .unwrap_or("");
                b64::decode(w).map(|w| w.len()).unwrap_or(0)
            };
            let (mut warm, mut work) = (warm, work);
            let s2 = senders.clone();
            let (warm, work) = tokio::task::spawn_blocking(move || {
                sign_all(&s2, &mut warm);
                sign_all(&s2, &mut work);
                (warm, work)
            })
            .await
            .map_err(|e| e.to_string())?;
            // Warm-up: one request per sender (connections opened, caches warm), not counted.
            run_senders(ctx, &relay, &senders, warm).await?;
            let stats0 = relay.stats(ctx).await?;
            let (rcpu0, gcpu0, wcpu0) = (relay.cpu_us()?, self_cpu_us()?, relay.writer_cpu_us()?);
            let t0 = Instant::now();
            let n = run_senders(ctx, &relay, &senders, work).await?;
            let elapsed = t0.elapsed().as_secs_f64();
            let (rcpu1, gcpu1, wcpu1) = (relay.cpu_us()?, self_cpu_us()?, relay.writer_cpu_us()?);
            let stats1 = relay.stats(ctx).await?;
            relay.check_alive()?;
            let d = |k: &str| {
                stats1[k]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(stats0[k].as_u64().unwrap_or(0)) as f64
            };
            let commits = d("commits").max(1.0);
            let rate = n as f64 / elapsed;
            eprintln!(
                "bench relay: {id} run {}/{runs}: {n} items in {elapsed:.2} s = {rate:.0} items/s, {:.1} items per commit",
                run + 1,
                n as f64 / commits
            );
            rates.push(rate);
            per_fsync.push(n as f64 / commits);
            reqs_per_commit.push(d("write_requests") / commits);
            relay_cpu.push((rcpu1 - rcpu0) / n as f64);
            writer_cpu.push((wcpu1 - wcpu0) / n as f64);
            gen_cpu.push((gcpu1 - gcpu0) / n as f64);
            secs.push(elapsed);
            relay.stop().await?;
            let _ = std::fs::remove_dir_all(&dir);
        }
        report(
            id,
            &format!(
                "relay durable accepts, {batch} item(s)/request, {SENDERS} senders, sealed items of {wire_bytes} B"
            ),
            "items/s",
            &rates,
            &[
                ("items_per_fsync", per_fsync),
                ("write_requests_per_commit", reqs_per_commit),
                ("relay_cpu_us_per_item", relay_cpu),
                ("writer_cpu_us_per_item", writer_cpu),
                ("loadgen_cpu_us_per_item", gen_cpu),
                ("seconds", secs),
            ],
            json!({
                "items_per_run": SENDERS * requests * batch,
                "senders": SENDERS,
                "targets": TARGETS,
                "batch": batch,
                "wire_bytes": wire_bytes,
            }),
        );
    }
    Ok(())
}

/// Runs one task per sender over its requests; the total of accepted items.
async fn run_senders(
    ctx: &Ctx,
    relay: &RelayProc,
    senders: &[Arc<Host>],
    work: Vec<Vec<Request>>,
) -> Res<usize> {
    let mut tasks = Vec::new();
    for reqs in work.into_iter().take(senders.len()) {
        tasks.push(tokio::spawn(send_all(
            ctx.http.clone(),
            relay.base.clone(),
            reqs,
        )));
    }
    let mut n = 0;
    for t in tasks {
        n += t.await.map_err(|e| e.to_string())??;
    }
    Ok(n)
}

// ---- figures 2 and 3: pulls ----------------------------------------------------------------

/// Pulls one page of `host`'s queue after `after` (the relay's `max_pull`); returns the page.
async fn pull_page(ctx: &Ctx, base: &str, host: &Host, after: i64) -> Res<PullResponse> {
    let target = format!("/v2/relay/items?after={after}");
    let (status, text) = hop_request(&ctx.http, base, host, "GET", &target, String::new()).await?;
    if status != 200 {
        return Err(format!("pull answered {status}: {text}"));
    }
    serde_json::from_str(&text).map_err(|e| format!("pull answer: {e}"))
}

/// Drains `host`'s queue as a host does (page, decode, ack through the page's last seq, next
/// page); returns the items received.
async fn drain(ctx: &Ctx, base: &str, host: &Host) -> Res<usize> {
    let mut after = 0;
    let mut n = 0;
    loop {
        let page = pull_page(ctx, base, host, after).await?;
        if page.items.is_empty() {
            return Ok(n);
        }
        for item in &page.items {
            b64::decode(&item.wire_b64).map_err(|_| "a pulled wire is not base64".to_string())?;
        }
        n += page.items.len();
        let body = json!({"epoch": page.epoch, "through": page.last_seq}).to_string();
        let (status, text) =
            hop_request(&ctx.http, base, host, "POST", "/v2/relay/ack", body).await?;
        if status != 200 {
            return Err(format!("ack answered {status}: {text}"));
        }
        after = page.last_seq;
        if !page.more {
            return Ok(n);
        }
    }
}

async fn pull_drain(ctx: &Ctx, sizes: &Sizes, runs: usize) -> Res<()> {
    let dir = ctx.store_dir("pull")?;
    let key = HostKey::generate();
    let sender = Host::new("sender-000");
    let receivers: Vec<Host> = (0..runs)
        .map(|i| Host::new(&format!("receiver-{i:03}")))
        .collect();
    eprintln!(
        "bench relay: pull: seeding {runs} queue(s) of {} items…",
        sizes.drain_items
    );
    let seeded = seed::seed(
        &dir,
        &key,
        &sender,
        &receivers
            .iter()
            .map(|r| (r, sizes.drain_items))
            .collect::<Vec<_>>(),
        body_len_for_1k(),
    )?;
    eprintln!("bench relay: pull: {}", seeded.describe());
    let mut relay = RelayProc::start(ctx, &dir, &key).await?;
    let mut rates = Vec::new();
    let (mut relay_cpu, mut gen_cpu, mut per_commit) = (vec![], vec![], vec![]);
    for (run, r) in receivers.iter().enumerate() {
        let stats0 = relay.stats(ctx).await?;
        let (rcpu0, gcpu0) = (relay.cpu_us()?, self_cpu_us()?);
        let t0 = Instant::now();
        let n = drain(ctx, &relay.base, r).await?;
        let elapsed = t0.elapsed().as_secs_f64();
        let (rcpu1, gcpu1) = (relay.cpu_us()?, self_cpu_us()?);
        let stats1 = relay.stats(ctx).await?;
        relay.check_alive()?;
        if n != sizes.drain_items {
            return Err(format!(
                "drained {n} items, {} were queued",
                sizes.drain_items
            ));
        }
        let commits =
            stats1["commits"].as_u64().unwrap_or(0) - stats0["commits"].as_u64().unwrap_or(0);
        let rate = n as f64 / elapsed;
        eprintln!(
            "bench relay: relay_pull_drain run {}/{runs}: {n} items in {elapsed:.2} s = {rate:.0} items/s",
            run + 1
        );
        rates.push(rate);
        relay_cpu.push((rcpu1 - rcpu0) / n as f64);
        gen_cpu.push((gcpu1 - gcpu0) / n as f64);
        per_commit.push(n as f64 / (commits.max(1)) as f64);
    }
    relay.stop().await?;
    report(
        "relay_pull_drain",
        &format!(
            "pull drain by one receiver (page + ack), queue of {} sealed items",
            sizes.drain_items
        ),
        "items/s",
        &rates,
        &[
            ("relay_cpu_us_per_item", relay_cpu),
            ("loadgen_cpu_us_per_item", gen_cpu),
            ("items_per_ack_commit", per_commit),
        ],
        json!({
            "queue_items": sizes.drain_items,
            "seed_items_per_s": round(seeded.items_per_s(), 0),
            "seed_method": seeded.method,
        }),
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

async fn page_latency(ctx: &Ctx, sizes: &Sizes, runs: usize) -> Res<()> {
    let dir = ctx.store_dir("page")?;
    let key = HostKey::generate();
    let sender = Host::new("sender-000");
    let small = Host::new("receiver-small");
    let deep = Host::new("receiver-deep");
    eprintln!(
        "bench relay: page-latency: seeding {} and {} items…",
        sizes.page_small, sizes.page_deep
    );
    let seeded = seed::seed(
        &dir,
        &key,
        &sender,
        &[(&small, sizes.page_small), (&deep, sizes.page_deep)],
        body_len_for_1k(),
    )?;
    eprintln!("bench relay: page-latency: {}", seeded.describe());
    let mut relay = RelayProc::start(ctx, &dir, &key).await?;
    // Warm-up: a few pulls of each queue, not counted.
    for h in [&small, &deep] {
        for _ in 0..5 {
            pull_page(ctx, &relay.base, h, 0).await?;
        }
    }
    let (mut p50_small, mut p50_deep, mut p99_small, mut p99_deep) =
        (vec![], vec![], vec![], vec![]);
    let mut page_items = (0, 0);
    for run in 0..runs {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        // Alternate the two queues so both see the same machine state.
        for _ in 0..sizes.page_pulls {
            for (h, out, depth) in [
                (&small, &mut a, sizes.page_small),
                (&deep, &mut b, sizes.page_deep),
            ] {
                let t0 = Instant::now();
                let page = pull_page(ctx, &relay.base, h, 0).await?;
                out.push(t0.elapsed().as_secs_f64() * 1e3);
                if page.head_seq == 0 || page.items.is_empty() {
                    return Err(format!("{depth}-item queue pulled empty"));
                }
                if depth == sizes.page_small {
                    page_items.0 = page.items.len();
                } else {
                    page_items.1 = page.items.len();
                }
            }
        }
        relay.check_alive()?;
        eprintln!(
            "bench relay: page-latency run {}/{runs}: p50 {:.2} ms ({} queued) vs {:.2} ms ({} queued)",
            run + 1,
            median(&a),
            sizes.page_small,
            median(&b),
            sizes.page_deep
        );
        p50_small.push(median(&a));
        p50_deep.push(median(&b));
        p99_small.push(percentile(&a, 99.0));
        p99_deep.push(percentile(&b, 99.0));
    }
    relay.stop().await?;
    let ratio: Vec<f64> = p50_deep
        .iter()
        .zip(&p50_small)
        .map(|(d, s)| d / s)
        .collect();
    report(
        "relay_page_1k",
        &format!(
            "one pull page, {} items queued for the target (p50 of {} pulls)",
            sizes.page_small, sizes.page_pulls
        ),
        "ms",
        &p50_small,
        &[("p99_ms", p99_small)],
        json!({"queued": sizes.page_small, "page_items": page_items.0}),
    );
    report(
        "relay_page_1m",
        &format!(
            "one pull page, {} items queued for the target (p50 of {} pulls)",
            sizes.page_deep, sizes.page_pulls
        ),
        "ms",
        &p50_deep,
        &[("p99_ms", p99_deep), ("ratio_to_1k", ratio)],
        json!({
            "queued": sizes.page_deep,
            "page_items": page_items.1,
            "seed_seconds": round(seeded.seconds, 1),
            "seed_items_per_s": round(seeded.items_per_s(), 0),
            "seed_method": seeded.method,
        }),
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
