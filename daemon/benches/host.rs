//! Host-side benchmarks and the report writer behind `bench/run` (not part of the test suite;
//! nothing here asserts a time).
//!
//! `cargo bench -p agentmbx --bench host -- <scenario> [--runs N] [--quick] [--dir DIR]`, with
//! scenario one of:
//! - `disk`: this disk's physical sync limit: 4 KiB overwrites of a preallocated 4 MiB file in
//!   `DIR`, each followed by `fsync` (`disk_fsync`) or `fdatasync` (`disk_fdatasync`), ~2 s
//!   per run (ops/s, p50 latency in `extra`);
//! - `redis`: the durable baseline: `redis-server` on 127.0.0.1 (random free port,
//!   `appendonly yes`, `appendfsync always`, no RDB snapshots, store in `DIR`) driven by
//!   `redis-benchmark` with `XADD` of 1 KiB values at 1 and 50 clients (`redis_xadd_c1`,
//!   `redis_xadd_c50`, ops/s); every run checks `XLEN` and that the AOF grew by at least the
//!   bytes written;
//! - `e2e`: end-to-end latency of the real release binary: local API send on host A until the
//!   message is listed by host B's `GET /v1/inbox`, through a relay (`e2e_relay_p50/p99`) and
//!   over the LAN (`e2e_lan_p50/p99`), in ms, in a closed loop (one message in flight);
//! - `wait`: one daemon; a long poll (`GET /v1/inbox?as=bob&wait=30&cursor=`) is open when
//!   alice sends bob a message through the local API: ms from just before the send request to
//!   the waiter's answer (`wait_local_p50/p99`), one message at a time;
//!   Then the same through `agentmbx mcp --as bob` over stdio (JSON-RPC written here): a
//!   `tools/call mbx_wait {cursor, timeout_s: 30}` is waiting in the daemon when alice sends:
//!   ms from just before the send request to the tool's answer line (`wait_mcp_p50/p99`);
//!   Then wake: per message a new agent's `agentmbx mcp` session whose channel watcher waits
//!   in the daemon; alice sends it a `request`: ms from just before the send request to the
//!   `notifications/claude/channel` line (`wake_channel_p50/p99`);
//!   The relay path runs twice in the same run: with B on the push stream (`e2e_relay_*`) and
//!   with the stream off, B polling every 2 s (`e2e_relay_polling_*`);
//! - `failover`: A knows a LAN address for B that refuses connections (`refused`) or accepts
//!   and never answers (`hung`); a relay is the other route: ms to the first message and p50/max
//!   of the next 20 (`failover_<mode>_first_ms`, `_next_p50`, `_next_max`), fresh homes per run;
//! - `idle`: a daemon with a relay configured and no traffic: RSS, CPU and wakeups;
//! - `start`: daemon start to `READY=1` (sd-notify datagram) on a fresh and an existing home;
//! - `all`: every scenario above, in that order;
//! - `report --in FILE --machine FILE --out FILE`: reads `BENCH` lines and a machine
//!   description, prints the table and writes it as Markdown.
//!
//! Each figure prints one line `BENCH {"id","label","unit","median","min","max","runs","extra"}`
//! on stdout; progress goes to stderr. Every process started here binds 127.0.0.1 only, has
//! its own home under `DIR` and is killed when its guard drops (also on a panic).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

/// Longest wait for anything a benchmark waits for (a process to announce itself, a message).
const TIMEOUT: Duration = Duration::from_secs(60);

/// Pause between two polls of B's inbox in the end-to-end figure (plus one request, ~0.2 ms).
const INBOX_POLL: Duration = Duration::from_millis(1);

/// Size of the message body and of the Redis value (bytes).
const VALUE_BYTES: usize = 1024;

/// Command-line options shared by every scenario.
#[derive(Debug, Clone)]
struct Opts {
    scenario: String,
    runs: usize,
    quick: bool,
    dir: PathBuf,
    input: Option<PathBuf>,
    machine: Option<PathBuf>,
    out: Option<PathBuf>,
}

fn parse_args() -> Result<Opts> {
    let mut opts = Opts {
        scenario: String::new(),
        runs: 5,
        quick: false,
        dir: std::env::temp_dir(),
        input: None,
        machine: None,
        out: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            // Cargo passes `--bench` to every bench binary.
            "--bench" => {}
            "--quick" => opts.quick = true,
            "--runs" => opts.runs = value("--runs")?.parse().context("--runs")?,
            "--dir" => opts.dir = PathBuf::from(value("--dir")?),
            "--in" => opts.input = Some(PathBuf::from(value("--in")?)),
            "--machine" => opts.machine = Some(PathBuf::from(value("--machine")?)),
            "--out" => opts.out = Some(PathBuf::from(value("--out")?)),
            s if s.starts_with("--") => bail!("unknown option {s}"),
            s if opts.scenario.is_empty() => opts.scenario = s.to_string(),
            s => bail!("unexpected argument {s}"),
        }
    }
    if opts.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if opts.quick {
        opts.runs = 1;
    }
    if opts.scenario.is_empty() {
        opts.scenario = "all".to_string();
    }
    Ok(opts)
}

fn main() -> Result<()> {
    let opts = parse_args()?;
    std::fs::create_dir_all(&opts.dir).with_context(|| format!("{}", opts.dir.display()))?;
    if opts.scenario != "report" {
        pin_binary(&opts.dir)?;
    }
    match opts.scenario.as_str() {
        "disk" => disk(&opts),
        "redis" => redis(&opts),
        "e2e" => e2e(&opts),
        "failover" => failover(&opts),
        "wait" => wait(&opts),
        "idle" => idle(&opts),
        "start" => start(&opts),
        "all" => {
            disk(&opts)?;
            redis(&opts)?;
            e2e(&opts)?;
            failover(&opts)?;
            wait(&opts)?;
            idle(&opts)?;
            start(&opts)
        }
        "report" => report(&opts),
        s => {
            bail!("unknown scenario {s} (disk | redis | e2e | failover | wait | idle | start | all | report)")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Figures and statistics

/// The median of `v` (mean of the two middle values for an even count); 0 when empty.
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The nearest-rank percentile `p` (0..=100) of `v`; 0 when empty.
fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Prints one `BENCH` line: the median, min and max of one value per run.
fn emit(id: &str, label: &str, unit: &str, samples: &[f64], extra: Value) {
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let max = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let line = json!({
        "id": id,
        "label": label,
        "unit": unit,
        "median": round3(median(samples)),
        "min": round3(min),
        "max": round3(max),
        "runs": samples.len(),
        "extra": extra,
    });
    println!("BENCH {line}");
    eprintln!(
        "  {id}: median {:.3} {unit} over {} runs",
        median(samples),
        samples.len()
    );
}

// ---------------------------------------------------------------------------------------------
// Disk

fn disk(o: &Opts) -> Result<()> {
    const BLOCK: usize = 4096;
    const BLOCKS: u64 = 1024;
    let secs = if o.quick { 1.0 } else { 2.0 };
    let path = o.dir.join("fsync-probe.bin");
    for (id, label, data_only) in [
        ("disk_fsync", "disk: 4 KiB write + fsync", false),
        ("disk_fdatasync", "disk: 4 KiB write + fdatasync", true),
    ] {
        eprintln!("{id}: {} run(s) of {secs} s on {}", o.runs, path.display());
        let mut rates = Vec::new();
        let mut p50s = Vec::new();
        for _ in 0..o.runs {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .with_context(|| format!("open {}", path.display()))?;
            file.write_all_at(&vec![0u8; BLOCK * BLOCKS as usize], 0)?;
            file.sync_all()?;
            let block = vec![0xa5u8; BLOCK];
            let mut lat = Vec::new();
            let start = Instant::now();
            let mut i = 0u64;
            while start.elapsed().as_secs_f64() < secs {
                let t = Instant::now();
                file.write_all_at(&block, (i % BLOCKS) * BLOCK as u64)?;
                if data_only {
                    file.sync_data()?;
                } else {
                    file.sync_all()?;
                }
                lat.push(t.elapsed().as_secs_f64() * 1e3);
                i += 1;
            }
            rates.push(i as f64 / start.elapsed().as_secs_f64());
            p50s.push(percentile(&lat, 50.0));
        }
        let _ = std::fs::remove_file(&path);
        emit(
            id,
            label,
            "ops/s",
            &rates,
            json!({
                "p50_latency_ms": round3(median(&p50s)),
                "mode": "overwrite 4 KiB blocks of a preallocated 4 MiB file in the bench dir",
                "seconds_per_run": secs,
            }),
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Child processes

/// A child process killed (SIGTERM, then SIGKILL) when dropped, with its stderr collected.
#[derive(Debug)]
struct Proc {
    name: String,
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command) -> Result<Proc> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawn {name}"))?;
        let log = Arc::new(Mutex::new(String::new()));
        if let Some(stderr) = child.stderr.take() {
            let sink = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Ok(mut text) = sink.lock() {
                        text.push_str(&line);
                        text.push('\n');
                    }
                }
            });
        }
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log(&self) -> String {
        self.log.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Waits until the log contains `needle`; fails when the process exits or after TIMEOUT.
    fn wait_log(&mut self, needle: &str) -> Result<String> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let log = self.log();
            if log.contains(needle) {
                return Ok(log);
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before logging {needle:?}:\n{log}",
                    self.name
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not log {needle:?} within {TIMEOUT:?}:\n{log}",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The address after the first `<announce>` in the log.
    fn announced(&mut self, announce: &str) -> Result<SocketAddr> {
        let log = self.wait_log(announce)?;
        let line = log
            .lines()
            .find(|l| l.contains(announce))
            .context("announce line")?;
        let rest = &line[line.find(announce).context("announce")? + announce.len()..];
        rest.split_whitespace()
            .next()
            .context("address")?
            .parse()
            .with_context(|| format!("address in {line:?}"))
    }

    fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The release binary under measurement: a private copy, taken at start, of `MBX_BENCH_BIN`
/// when set (bench/run sets it, so every step measures the same file) or else of the one cargo
/// built for this bench, so a rebuild of the target directory during the run changes nothing.
static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn bin() -> &'static Path {
    BIN.get()
        .map(PathBuf::as_path)
        .unwrap_or(Path::new(env!("CARGO_BIN_EXE_agentmbx")))
}

/// Copies the built binary into `dir` and uses the copy from now on.
fn pin_binary(dir: &Path) -> Result<()> {
    let built = std::env::var_os("MBX_BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_agentmbx")));
    let built = built.as_path();
    let copy = dir.join("agentmbx");
    std::fs::copy(built, &copy).with_context(|| format!("copy {}", built.display()))?;
    let _ = BIN.set(copy);
    Ok(())
}

/// `agentmbx <args>` in `home` with none of the caller's `MBX_*` variables, no mDNS, keys in
/// files, the LAN server on 127.0.0.1 port 0 and info logs.
fn mbx(home: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("MBX_") || name == "PORT" || name == "NOTIFY_SOCKET" {
            cmd.env_remove(name);
        }
    }
    cmd.env("MBX_HOME", home)
        .env("MBX_NO_MDNS", "1")
        .env("MBX_KEYSTORE", "file")
        .env("MBX_LAN_BIND", "127.0.0.1")
        .env("MBX_LAN_PORT", "0")
        .env("MBX_LOG", "info")
        .args(args);
    cmd
}

/// Runs `agentmbx <args>` in `home` to completion; its stdout, or an error with both streams.
fn mbx_run(home: &Path, args: &[&str]) -> Result<String> {
    let out = mbx(home, args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run agentmbx {args:?}"))?;
    if !out.status.success() {
        bail!(
            "agentmbx {args:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

// ---------------------------------------------------------------------------------------------
// Minimal HTTP/1.1 keep-alive client (std only, loopback)

/// One keep-alive connection to a daemon's local API, with its bearer token.
#[derive(Debug)]
struct Api {
    addr: SocketAddr,
    token: String,
    conn: Option<BufReader<TcpStream>>,
}

impl Api {
    fn new(addr: SocketAddr, home: &Path) -> Result<Api> {
        let token = std::fs::read_to_string(home.join("api.token"))
            .context("read api.token")?
            .trim()
            .to_string();
        Ok(Api {
            addr,
            token,
            conn: None,
        })
    }

    /// One request; a connection the daemon closed meanwhile is reopened once.
    fn call(&mut self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Value)> {
        let body = body.map(Value::to_string).unwrap_or_default();
        let reused = self.conn.is_some();
        match self.try_call(method, path, &body) {
            Ok(r) => Ok(r),
            Err(_) if reused => {
                self.conn = None;
                self.try_call(method, path, &body)
            }
            Err(e) => Err(e),
        }
    }

    fn try_call(&mut self, method: &str, path: &str, body: &str) -> Result<(u16, Value)> {
        if self.conn.is_none() {
            let stream = TcpStream::connect_timeout(&self.addr, TIMEOUT)?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(TIMEOUT))?;
            self.conn = Some(BufReader::new(stream));
        }
        let conn = self.conn.as_mut().context("connection")?;
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n",
            self.addr, self.token
        );
        if !body.is_empty() {
            req.push_str("Content-Type: application/json\r\n");
        }
        req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        conn.get_mut().write_all(req.as_bytes())?;
        let mut line = String::new();
        if conn.read_line(&mut line)? == 0 {
            self.conn = None;
            bail!("connection closed");
        }
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("status line {line:?}"))?;
        let (mut length, mut chunked, mut close) = (None, false, false);
        loop {
            line.clear();
            conn.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((name, value)) = l.split_once(':') {
                let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
                match name.as_str() {
                    "content-length" => length = value.parse::<usize>().ok(),
                    "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                    "connection" => close = value.eq_ignore_ascii_case("close"),
                    _ => {}
                }
            }
        }
        let mut raw = Vec::new();
        if chunked {
            loop {
                line.clear();
                conn.read_line(&mut line)?;
                let size = usize::from_str_radix(line.trim(), 16).context("chunk size")?;
                let mut chunk = vec![0u8; size + 2];
                conn.read_exact(&mut chunk)?;
                if size == 0 {
                    break;
                }
                raw.extend_from_slice(&chunk[..size]);
            }
        } else if let Some(n) = length {
            raw.resize(n, 0);
            conn.read_exact(&mut raw)?;
        } else {
            conn.read_to_end(&mut raw)?;
            close = true;
        }
        if close {
            self.conn = None;
        }
        let value = if raw.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&raw).unwrap_or(Value::Null)
        };
        Ok((status, value))
    }
}

// ---------------------------------------------------------------------------------------------
// Redis baseline

/// One RESP command over a fresh connection; the reply's first line.
fn redis_cmd(port: u16, args: &[&str]) -> Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    stream.write_all(req.as_bytes())?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    Ok(line.trim_end().to_string())
}

/// `CONFIG GET <name>`: the value (the fifth line of the two-element array reply).
fn redis_config(port: u16, name: &str) -> Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    let req = format!(
        "*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n${}\r\n{name}\r\n",
        name.len()
    );
    stream.write_all(req.as_bytes())?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    for _ in 0..5 {
        line.clear();
        reader.read_line(&mut line)?;
    }
    Ok(line.trim_end().to_string())
}

/// Total size of the files under `dir` (bytes).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// One redis-benchmark run: `(ops/s, p50 ms)`.
fn redis_benchmark(port: u16, clients: usize, n: u64, value: &str) -> Result<(f64, f64)> {
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-c",
            &clients.to_string(),
            "-n",
            &n.to_string(),
            "--csv",
            "XADD",
            "bench:stream",
            "*",
            "f",
            value,
        ])
        .stdin(Stdio::null())
        .output()
        .context("run redis-benchmark")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "redis-benchmark failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95…","p99…","max…"
    let row = text
        .lines()
        .rfind(|l| l.contains("XADD"))
        .with_context(|| format!("no XADD row in redis-benchmark output: {text}"))?;
    let fields: Vec<f64> = row
        .rsplit(',')
        .take(7)
        .map(|f| f.trim_matches('"').parse::<f64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("redis-benchmark row {row:?}"))?;
    // Reversed: max, p99, p95, p50, min, avg, rps.
    Ok((fields[6], fields[3]))
}

fn redis(o: &Opts) -> Result<()> {
    if !have("redis-server") || !have("redis-benchmark") {
        eprintln!(
            "NOTE: redis-server / redis-benchmark not found: no Redis baseline \
             (Debian/Ubuntu: apt-get install redis-server redis-tools)"
        );
        return Ok(());
    }
    let dir = o.dir.join("redis");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let port = free_port()?;
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--bind",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
        "--auto-aof-rewrite-percentage",
        "0",
        "--daemonize",
        "no",
        "--dir",
    ])
    .arg(&dir);
    let server = Proc::spawn("redis-server", cmd)?;
    let deadline = Instant::now() + TIMEOUT;
    while redis_cmd(port, &["PING"]).ok().as_deref() != Some("+PONG") {
        if Instant::now() >= deadline {
            bail!("redis-server did not answer PING:\n{}", server.log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let fsync_mode = redis_config(port, "appendfsync")?;
    if fsync_mode != "always" {
        bail!("redis-server runs with appendfsync {fsync_mode}, not always");
    }
    let version = Command::new("redis-server")
        .arg("--version")
        .output()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.split_whitespace()
                .find_map(|w| w.strip_prefix("v="))
                .unwrap_or(text.trim())
                .to_string()
        })
        .unwrap_or_default();
    eprintln!(
        "redis-server on 127.0.0.1:{port} ({version}), AOF in {}",
        dir.display()
    );
    let value: String = (0..VALUE_BYTES)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let secs = if o.quick { 1.0 } else { 3.0 };
    for (id, clients) in [("redis_xadd_c1", 1usize), ("redis_xadd_c50", 50)] {
        // A short calibration run sizes N so that each measured run lasts about `secs`.
        let (rate, _) = redis_benchmark(port, clients, 50 * clients as u64 + 200, &value)?;
        let n = ((rate * secs) as u64).clamp(500, 5_000_000);
        eprintln!("{id}: {} run(s) of {n} XADDs ({clients} clients)", o.runs);
        let mut rates = Vec::new();
        let mut p50s = Vec::new();
        let mut aof_per_op = Vec::new();
        for _ in 0..o.runs {
            redis_cmd(port, &["DEL", "bench:stream"])?;
            let before = dir_bytes(&dir);
            let (rps, p50) = redis_benchmark(port, clients, n, &value)?;
            let xlen = redis_cmd(port, &["XLEN", "bench:stream"])?;
            if xlen != format!(":{n}") {
                bail!("XLEN after {n} XADDs answered {xlen}");
            }
            let grown = dir_bytes(&dir).saturating_sub(before);
            if grown < n * VALUE_BYTES as u64 {
                bail!("the AOF grew by {grown} bytes for {n} XADDs of {VALUE_BYTES} bytes");
            }
            rates.push(rps);
            p50s.push(p50);
            aof_per_op.push(grown as f64 / n as f64);
        }
        redis_cmd(port, &["DEL", "bench:stream"])?;
        emit(
            id,
            &format!("Redis XADD 1 KiB, appendfsync always, {clients} client(s)"),
            "ops/s",
            &rates,
            json!({
                "clients": clients,
                "requests_per_run": n,
                "p50_latency_ms": round3(median(&p50s)),
                "aof_bytes_per_op": round3(median(&aof_per_op)),
                "xlen_checked": true,
                "appendfsync": fsync_mode,
                "version": version,
            }),
        );
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// End-to-end latency

/// A relay child on 127.0.0.1 with its store and key fingerprint.
#[derive(Debug)]
struct Relay {
    _proc: Proc,
    url: String,
    fingerprint: String,
}

fn start_relay(dir: &Path) -> Result<Relay> {
    let store = dir.join("relay-store");
    std::fs::create_dir_all(&store)?;
    // The defaults (120 pushes a minute per address) would refuse a benchmark.
    std::fs::write(
        store.join("relay.toml"),
        "[rate]\npush_per_min = 1000000\ninfo_per_min = 1000000\nenrol_per_min = 1000000\n",
    )?;
    let port = free_port()?.to_string();
    let store_s = store.to_str().context("UTF-8 store path")?;
    let cmd = mbx(
        &dir.join("relay-home"),
        &[
            "relay",
            "serve",
            "--bind",
            "127.0.0.1",
            "--port",
            &port,
            "--store-dir",
            store_s,
        ],
    );
    let mut proc = Proc::spawn("relay", cmd)?;
    let addr = proc.announced("relay listening on ")?;
    let log = proc.log();
    let fingerprint = log
        .split("fingerprint=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .with_context(|| format!("no relay fingerprint in the log:\n{log}"))?
        .to_string();
    Ok(Relay {
        _proc: proc,
        url: format!("http://{addr}"),
        fingerprint,
    })
}

/// One host: its home, public key and running daemon.
#[derive(Debug)]
struct Host {
    name: String,
    home: PathBuf,
    pubkey: String,
    daemon: Option<Proc>,
    api_addr: Option<SocketAddr>,
    /// Variables set on the daemon at [`Host::start`] (e.g. `MBX_RELAY_STREAM=0`).
    env: Vec<(&'static str, &'static str)>,
}

impl Host {
    fn init(dir: &Path, name: &str) -> Result<Host> {
        let home = dir.join(name);
        mbx_run(&home, &["init", "--host", name])?;
        // The local API's rate classes out of the way: the figures are of delivery, and a
        // sender or poller here runs far faster than an agent (the classes are tested in
        // tests/rate.rs and the API's unit tests).
        let mut config = std::fs::OpenOptions::new()
            .append(true)
            .open(home.join("config.toml"))
            .context("config.toml")?;
        let unlimited: String = ["wait", "send", "register", "other"]
            .iter()
            .map(|c| format!("{c}_burst = 1000000\n{c}_per_min = 6000000\n"))
            .collect();
        write!(config, "\n[api_rate]\n{unlimited}")?;
        let who: Value = serde_json::from_str(&mbx_run(&home, &["whoami", "--json"])?)?;
        let pubkey = who["host_pubkey"]
            .as_str()
            .context("host_pubkey")?
            .to_string();
        Ok(Host {
            name: name.to_string(),
            home,
            pubkey,
            daemon: None,
            api_addr: None,
            env: Vec::new(),
        })
    }

    /// Starts the daemon with the product's defaults (relay pull interval included; rate
    /// classes raised at init).
    fn start(&mut self) -> Result<()> {
        let mut cmd = mbx(&self.home, &["daemon", "--api-port", "0"]);
        cmd.envs(self.env.iter().copied());
        let mut proc = Proc::spawn(&format!("{} daemon", self.name), cmd)?;
        self.api_addr = Some(proc.announced("local API listening on ")?);
        self.daemon = Some(proc);
        Ok(())
    }

    /// Stops the daemon (SIGTERM, then SIGKILL after 10 s).
    fn stop(&mut self) {
        if let Some(mut proc) = self.daemon.take() {
            proc.stop();
        }
        self.api_addr = None;
    }

    fn daemon(&mut self) -> Result<&mut Proc> {
        self.daemon.as_mut().context("daemon not running")
    }

    fn api(&self) -> Result<Api> {
        Api::new(self.api_addr.context("daemon not running")?, &self.home)
    }

    fn set_relay(&self, relay: &Relay) -> Result<()> {
        mbx_run(
            &self.home,
            &[
                "relay",
                "set",
                &relay.url,
                "--key",
                &relay.fingerprint,
                "--json",
            ],
        )
        .map(drop)
    }

    fn pins(&self, other: &str) -> Result<bool> {
        let peers: Value = serde_json::from_str(&mbx_run(&self.home, &["peers", "--json"])?)?;
        Ok(peers
            .as_array()
            .is_some_and(|l| l.iter().any(|p| p["host"] == other)))
    }
}

/// Latencies (ms) of `n` messages sent from `a` (agent alice) to bob@`b_name` in a closed
/// loop: one message is sent, B's inbox is polled every [`INBOX_POLL`] until it lists that
/// message (which is then acked), and only then is the next one sent, so each figure is the
/// latency of one message with nothing else in flight, never a backlog. Before each send the
/// loop pauses a pseudo-random time in `[0, jitter)`, so that sends do not lock onto the phase
/// of a periodic pull (`jitter` is the pull interval on the relay path, zero on the LAN path).
/// Each latency runs from just before the send request until the first poll that lists it.
fn latencies(
    a: &Host,
    b: &Host,
    n: usize,
    tag: &str,
    jitter: Duration,
    spacing: Duration,
) -> Result<Vec<f64>> {
    let body: String = (0..VALUE_BYTES)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    // bob is an agent of B, registered there before mail is addressed to it.
    mbx_run(&b.home, &["whoami", "--as", "bob"])?;
    let to = format!("bob@{}", b.name);
    let mut a_api = a.api()?;
    let mut b_api = b.api()?;
    // xorshift64, seeded from the clock: enough to spread the send times over the interval.
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x9e37_79b9_7f4a_7c15)
        | 1;
    let mut lat = Vec::with_capacity(n);
    let mut last_send: Option<Instant> = None;
    for i in 0..n {
        if let Some(gap) = last_send.map(|t| spacing.saturating_sub(t.elapsed())) {
            std::thread::sleep(gap);
        }
        if !jitter.is_zero() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            std::thread::sleep(jitter.mul_f64((seed >> 11) as f64 / (1u64 << 53) as f64));
        }
        let msg = json!({"from": "alice", "to": [to], "subject": format!("{tag} {i}"),
                         "body": body});
        let t0 = Instant::now();
        last_send = Some(t0);
        let (status, answer) = a_api.call("POST", "/v1/messages", Some(&msg))?;
        if status != 201 {
            bail!("send answered {status}: {answer}");
        }
        let id = answer["id"].as_str().context("id")?.to_string();
        let deadline = t0 + TIMEOUT;
        loop {
            let (status, page) = b_api.call("GET", "/v1/inbox?as=bob&limit=200", None)?;
            let now = Instant::now();
            if status != 200 {
                bail!("inbox answered {status}: {page}");
            }
            let ids: Vec<String> = page["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect();
            // `POST /v1/ack` takes at most 50 ids; acking keeps the unacked inbox empty.
            for chunk in ids.chunks(50) {
                let (status, answer) =
                    b_api.call("POST", "/v1/ack", Some(&json!({"as": "bob", "ids": chunk})))?;
                if status != 200 {
                    bail!("ack answered {status}: {answer}");
                }
            }
            if ids.contains(&id) {
                lat.push(now.duration_since(t0).as_secs_f64() * 1e3);
                break;
            }
            if now >= deadline {
                bail!(
                    "message {i} did not reach {}'s inbox within {TIMEOUT:?}",
                    b.name
                );
            }
            std::thread::sleep(INBOX_POLL);
        }
    }
    Ok(lat)
}

/// Runs `o.runs` closed-loop rounds of `n` messages (see [`latencies`]; `jitter` is the
/// longest pause before a send) and emits `<prefix>_p50` and `<prefix>_p99`.
#[allow(clippy::too_many_arguments)]
fn latency_figures(
    o: &Opts,
    a: &Host,
    b: &Host,
    prefix: &str,
    label: &str,
    n: usize,
    jitter: Duration,
    spacing: Duration,
    extra: Value,
) -> Result<()> {
    let (mut p50, mut p99, mut max) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..o.runs {
        eprintln!("{prefix}: run {}/{} ({n} messages)", run + 1, o.runs);
        let lat = latencies(a, b, n, &format!("{prefix}-{run}"), jitter, spacing)?;
        p50.push(percentile(&lat, 50.0));
        p99.push(percentile(&lat, 99.0));
        max.push(percentile(&lat, 100.0));
    }
    let mut extra = extra;
    if let Value::Object(m) = &mut extra {
        m.insert("messages_per_run".into(), json!(n));
        m.insert(
            "mode".into(),
            json!("closed loop: one message in flight, the next sent once B lists it"),
        );
        m.insert(
            "send_jitter_ms".into(),
            json!(format!("uniform 0..{}", jitter.as_millis())),
        );
        m.insert(
            "min_send_spacing_ms".into(),
            json!(spacing.as_millis() as u64),
        );
        m.insert(
            "inbox_poll_pause_ms".into(),
            json!(INBOX_POLL.as_millis() as u64),
        );
        m.insert("body_bytes".into(), json!(VALUE_BYTES));
        m.insert("max_ms_median".into(), json!(round3(median(&max))));
    }
    emit(
        &format!("{prefix}_p50"),
        &format!("{label}, p50"),
        "ms",
        &p50,
        extra.clone(),
    );
    emit(
        &format!("{prefix}_p99"),
        &format!("{label}, p99"),
        "ms",
        &p99,
        extra,
    );
    Ok(())
}

/// Least time between two LAN sends of the latency figure: B's per-peer rate limit
/// (`wire.md` §4, 600 signed requests a minute, one more every 100 ms).
const LAN_SEND_SPACING: Duration = Duration::from_millis(100);

/// What a daemon logs once its push stream to the relay is open.
const STREAM_UP_LOG: &str = "relay stream open";

/// Longest pause before a send on the push-stream path: enough to keep sends off any phase of
/// the daemon's own timers, short enough that a run of 200 stays short.
const STREAM_SEND_JITTER: Duration = Duration::from_millis(50);

fn e2e(o: &Opts) -> Result<()> {
    let dir = o.dir.join("e2e");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    {
        // Through the relay: the hosts pin each other without a LAN address, so the relay is
        // their only path. First with the push stream (the default), then, in the same run,
        // with the stream switched off (`MBX_RELAY_STREAM=0`): B pulls every 2 s.
        let relay = start_relay(&dir)?;
        let mut a = Host::init(&dir, "hosta")?;
        let mut b = Host::init(&dir, "hostb")?;
        mbx_run(&a.home, &["peers", "add", "hostb", &b.pubkey])?;
        mbx_run(&b.home, &["peers", "add", "hosta", &a.pubkey])?;
        a.set_relay(&relay)?;
        b.set_relay(&relay)?;
        a.start()?;
        b.start()?;
        for h in [&mut a, &mut b] {
            h.daemon()?.wait_log("published the enc-key ad")?;
        }
        b.daemon()?.wait_log(STREAM_UP_LOG)?;
        latency_figures(
            o,
            &a,
            &b,
            "e2e_relay",
            "end-to-end via the relay, push stream (send on A → listed in B's inbox)",
            if o.quick { 20 } else { 200 },
            STREAM_SEND_JITTER,
            Duration::ZERO,
            json!({
                "path": "relay only (peers pinned without a LAN address), B on the push stream",
            }),
        )?;
        for h in [&mut a, &mut b] {
            h.stop();
            h.env = vec![("MBX_RELAY_STREAM", "0")];
            h.start()?;
        }
        latency_figures(
            o,
            &a,
            &b,
            "e2e_relay_polling",
            "end-to-end via the relay, stream off: B polls (send on A → listed in B's inbox)",
            // Each message waits for a pull (every 2 s by default): 1,000 in a closed loop
            // would take over half an hour per run.
            if o.quick { 10 } else { 100 },
            Duration::from_millis(agentmbx::config::default_relay_pull_interval_ms()),
            Duration::ZERO,
            json!({
                "path": "relay only (peers pinned without a LAN address), MBX_RELAY_STREAM=0",
                "relay_pull_interval_ms": agentmbx::config::default_relay_pull_interval_ms(),
            }),
        )?;
        drop((a, b, relay));
    }
    {
        // Over the LAN: paired hosts, no relay configured.
        let mut c = Host::init(&dir, "hostc")?;
        let mut d = Host::init(&dir, "hostd")?;
        c.start()?;
        d.start()?;
        let pair: Value = serde_json::from_str(&mbx_run(&c.home, &["pair", "--json"])?)?;
        let token = pair["token"].as_str().context("pair token")?.to_string();
        let lan = c
            .daemon()?
            .announced("LAN server listening on ")?
            .to_string();
        mbx_run(&d.home, &["join", &lan, &token])?;
        let deadline = Instant::now() + TIMEOUT;
        while !(c.pins("hostd")? && d.pins("hostc")?) {
            if Instant::now() >= deadline {
                bail!("hostc and hostd did not pin each other");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        latency_figures(
            o,
            &c,
            &d,
            "e2e_lan",
            "end-to-end over the LAN (send on A → listed in B's inbox)",
            if o.quick { 50 } else { 1000 },
            Duration::ZERO,
            // One signed request from A to B per message; B's per-peer limit (`wire.md` §4) is
            // 600 a minute, so sends start at least 100 ms apart: the figure is the latency of
            // one message, not of a peer throttled for flooding.
            LAN_SEND_SPACING,
            json!({"path": "LAN only (paired on 127.0.0.1, no relay configured)"}),
        )?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Fail-over from a dead LAN address to the relay

/// A LAN address for hostb at A that never delivers, kept for as long as the value lives:
/// `refused` is a socket bound on 127.0.0.1 that never listens (every connect is refused and
/// the port stays reserved); `hung` is a listener whose connections are accepted and never
/// answered.
struct DeadAddr {
    addr: SocketAddr,
    _socket: socket2::Socket,
    _held: Arc<Mutex<Vec<TcpStream>>>,
}

fn dead_addr(mode: &str) -> Result<DeadAddr> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    socket.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
    let addr = socket
        .local_addr()?
        .as_socket()
        .context("a bound IPv4 address")?;
    let held = Arc::new(Mutex::new(Vec::new()));
    if mode == "hung" {
        socket.listen(128)?;
        let listener: TcpListener = socket.try_clone()?.into();
        let sink = Arc::clone(&held);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                if let Ok(mut held) = sink.lock() {
                    held.push(conn);
                }
            }
        });
    }
    Ok(DeadAddr {
        addr,
        _socket: socket,
        _held: held,
    })
}

/// Messages sent after the first one in each fail-over run.
const FAILOVER_NEXT: usize = 20;

/// A and B on one relay; A knows B's LAN address, but that address refuses connections or
/// accepts and never answers. Per run, with fresh homes: ms from the send of the first message
/// to B listing it (`failover_<mode>_first_ms`), then the latencies of the next 20, one at a
/// time (`failover_<mode>_next_p50/max`).
fn failover(o: &Opts) -> Result<()> {
    let dir = o.dir.join("failover");
    for mode in ["refused", "hung"] {
        let (mut first, mut next_p50, mut next_max) = (Vec::new(), Vec::new(), Vec::new());
        for run in 0..o.runs {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            eprintln!("failover {mode}: run {}/{}", run + 1, o.runs);
            let relay = start_relay(&dir)?;
            let dead = dead_addr(mode)?;
            let mut a = Host::init(&dir, "hosta")?;
            let mut b = Host::init(&dir, "hostb")?;
            mbx_run(&a.home, &["peers", "add", "hostb", &b.pubkey])?;
            mbx_run(&b.home, &["peers", "add", "hosta", &a.pubkey])?;
            mbx_run(
                &a.home,
                &["peers", "addr", "hostb", &dead.addr.to_string(), "--force"],
            )?;
            a.set_relay(&relay)?;
            b.set_relay(&relay)?;
            a.start()?;
            b.start()?;
            for h in [&mut a, &mut b] {
                h.daemon()?.wait_log("published the enc-key ad")?;
            }
            b.daemon()?.wait_log(STREAM_UP_LOG)?;
            let tag = format!("failover-{mode}-{run}");
            let lat = latencies(&a, &b, 1, &tag, Duration::ZERO, Duration::ZERO)?;
            first.push(lat[0]);
            let lat = latencies(
                &a,
                &b,
                FAILOVER_NEXT,
                &format!("{tag}-next"),
                STREAM_SEND_JITTER,
                Duration::ZERO,
            )?;
            next_p50.push(percentile(&lat, 50.0));
            next_max.push(percentile(&lat, 100.0));
            drop((a, b, relay, dead));
        }
        let extra = json!({
            "lan_address": if mode == "refused" {
                "127.0.0.1 port bound, never listening: every connect refused"
            } else {
                "127.0.0.1 listener: connections accepted, never answered"
            },
            "relay": "on 127.0.0.1, B on the push stream",
            "next_messages": FAILOVER_NEXT,
            "fresh_homes_per_run": true,
        });
        let what = if mode == "refused" {
            "LAN address refuses"
        } else {
            "LAN address accepts, never answers"
        };
        emit(
            &format!("failover_{mode}_first_ms"),
            &format!("fail-over to the relay, {what}: first message (send → listed at B)"),
            "ms",
            &first,
            extra.clone(),
        );
        emit(
            &format!("failover_{mode}_next_p50"),
            &format!("fail-over to the relay, {what}: next {FAILOVER_NEXT} messages, p50"),
            "ms",
            &next_p50,
            extra.clone(),
        );
        emit(
            &format!("failover_{mode}_next_max"),
            &format!("fail-over to the relay, {what}: next {FAILOVER_NEXT} messages, max"),
            "ms",
            &next_max,
            extra,
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Waiting for mail (long poll)

/// What the daemon logs (debug, inbox module) when a request starts waiting for mail.
const WAITING: &str = "a reader waits for mail";

/// Figure 6: a long poll open on bob's inbox answers a local send (see the module docs).
fn wait(o: &Opts) -> Result<()> {
    let dir = o.dir.join("wait");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mut h = Host::init(&dir, "hostw")?;
    for agent in ["alice", "bob"] {
        mbx_run(&h.home, &["whoami", "--as", agent])?;
    }
    let mut cmd = mbx(&h.home, &["daemon", "--api-port", "0"]);
    // The inbox module's debug line says when a waiter waits: the send starts only then.
    cmd.env("MBX_LOG", "info,agentmbx::api::inbox=debug");
    let mut proc = Proc::spawn("hostw daemon", cmd)?;
    h.api_addr = Some(proc.announced("local API listening on ")?);
    h.daemon = Some(proc);
    let n = if o.quick { 20 } else { 200 };
    let (mut p50, mut p99, mut max) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..o.runs {
        eprintln!("wait_local: run {}/{} ({n} messages)", run + 1, o.runs);
        let lat = long_polls(&mut h, n, run)?;
        p50.push(percentile(&lat, 50.0));
        p99.push(percentile(&lat, 99.0));
        max.push(percentile(&lat, 100.0));
    }
    let extra = json!({
        "messages_per_run": n,
        "mode": "one long poll open (wait=30, from the previous answer's cursor); the send starts once the daemon logged that the request waits",
        "body_bytes": VALUE_BYTES,
        "max_ms_median": round3(median(&max)),
    });
    let label = "local send → long-poll answer (GET /v1/inbox?wait=)";
    emit(
        "wait_local_p50",
        &format!("{label}, p50"),
        "ms",
        &p50,
        extra.clone(),
    );
    emit(
        "wait_local_p99",
        &format!("{label}, p99"),
        "ms",
        &p99,
        extra,
    );
    let (mut p50, mut p99, mut max) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..o.runs {
        eprintln!("wait_mcp: run {}/{} ({n} messages)", run + 1, o.runs);
        let lat = mcp_waits(&mut h, n, run)?;
        p50.push(percentile(&lat, 50.0));
        p99.push(percentile(&lat, 99.0));
        max.push(percentile(&lat, 100.0));
    }
    let extra = json!({
        "messages_per_run": n,
        "mode": "one agentmbx mcp --as bob session over stdio; a tools/call mbx_wait {cursor, timeout_s: 30} from the previous answer's next_cursor; the send starts once the daemon logged that its long poll waits",
        "body_bytes": VALUE_BYTES,
        "max_ms_median": round3(median(&max)),
    });
    let label = "message committed on the receiving host → mbx_wait answer (agentmbx mcp, stdio)";
    emit(
        "wait_mcp_p50",
        &format!("{label}, p50"),
        "ms",
        &p50,
        extra.clone(),
    );
    emit("wait_mcp_p99", &format!("{label}, p99"), "ms", &p99, extra);
    let n = if o.quick { 5 } else { 40 };
    let (mut p50, mut p99, mut max) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..o.runs {
        eprintln!("wake_channel: run {}/{} ({n} sessions)", run + 1, o.runs);
        let lat = channel_wakes(&mut h, n, run)?;
        p50.push(percentile(&lat, 50.0));
        p99.push(percentile(&lat, 99.0));
        max.push(percentile(&lat, 100.0));
    }
    let extra = json!({
        "messages_per_run": n,
        "mode": "one agentmbx mcp --as <new agent> session over stdio per message (the wake brake allows one wake per agent per 30 s); alice sends a kind=request message once the daemon logged that the session's channel watcher waits",
        "body_bytes": VALUE_BYTES,
        "max_ms_median": round3(median(&max)),
    });
    let label =
        "message committed on the receiving host → channel notification (agentmbx mcp, stdio)";
    emit(
        "wake_channel_p50",
        &format!("{label}, p50"),
        "ms",
        &p50,
        extra.clone(),
    );
    emit(
        "wake_channel_p99",
        &format!("{label}, p99"),
        "ms",
        &p99,
        extra,
    );
    drop(h);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A child process killed and reaped when dropped.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `n` sends alice → bob on `h`, each answered to a `tools/call mbx_wait` of bob's
/// `agentmbx mcp` session (JSON-RPC over its stdio, one line a message) made before the send;
/// the ms from just before each send request to the line of the tool's answer.
fn mcp_waits(h: &mut Host, n: usize, run: usize) -> Result<Vec<f64>> {
    let body: String = (0..VALUE_BYTES)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let mut cmd = mbx(&h.home, &["mcp", "--as", "bob"]);
    cmd.env("MBX_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = KillOnDrop(cmd.spawn().context("spawn agentmbx mcp")?);
    let mut stdin = child.0.stdin.take().context("mcp stdin")?;
    let stdout = child.0.stdout.take().context("mcp stdout")?;
    // Each line the server writes, with the moment it was read.
    let (tx, lines) = std::sync::mpsc::channel::<(String, Instant)>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send((line, Instant::now())).is_err() {
                break;
            }
        }
    });
    let mut send = |msg: Value| -> Result<()> {
        writeln!(stdin, "{msg}")?;
        stdin.flush()?;
        Ok(())
    };
    // The answer to request `id` (notifications are skipped).
    let answer = |id: u64| -> Result<(Value, Instant)> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (line, at) = lines
                .recv_timeout(left)
                .map_err(|_| anyhow::anyhow!("agentmbx mcp did not answer request {id}"))?;
            let v: Value = serde_json::from_str(&line).context("a JSON-RPC line")?;
            if v["id"] == json!(id) {
                return Ok((v, at));
            }
        }
    };
    send(
        json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "bench", "version": "0"}}}),
    )?;
    answer(0)?;
    send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))?;
    let mut api = h.api()?;
    // Wait from the end of bob's inbox (earlier figures left mail in it).
    let mut cursor = inbox_end(&mut api, "bob")?;
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let id = i as u64 + 1;
        let waiting = h.daemon()?.log().matches(WAITING).count();
        send(
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "mbx_wait", "arguments": {"cursor": cursor, "timeout_s": 30}}}),
        )?;
        let deadline = Instant::now() + TIMEOUT;
        while h.daemon()?.log().matches(WAITING).count() <= waiting {
            if Instant::now() >= deadline {
                bail!("mbx_wait did not start waiting within {TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let msg = json!({"from": "alice", "to": ["bob"], "subject": format!("mcp-{run} {i}"),
                         "body": body});
        let t0 = Instant::now();
        let (status, sent) = api.call("POST", "/v1/messages", Some(&msg))?;
        if status != 201 {
            bail!("send answered {status}: {sent}");
        }
        let (v, t1) = answer(id)?;
        let text = v["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default();
        let page: Value = serde_json::from_str(text).unwrap_or(Value::Null);
        if page["messages"][0]["id"] != sent["id"] {
            bail!("mbx_wait answered {v}");
        }
        cursor = page["next_cursor"]
            .as_str()
            .context("next_cursor")?
            .to_string();
        lat.push(t1.duration_since(t0).as_secs_f64() * 1e3);
    }
    Ok(lat)
}

/// `n` wake-worthy sends from alice, each to a new agent whose `agentmbx mcp` session (JSON-RPC
/// over its stdio) started before the send and whose channel watcher waits in the daemon; the
/// ms from just before each send request to the line of its `notifications/claude/channel`.
fn channel_wakes(h: &mut Host, n: usize, run: usize) -> Result<Vec<f64>> {
    let body: String = (0..VALUE_BYTES)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let mut api = h.api()?;
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        // The brake allows one wake per agent per 30 s: every message goes to a new agent.
        let agent = format!("wake{run}x{i}");
        mbx_run(&h.home, &["whoami", "--as", &agent])?;
        let waiting = h.daemon()?.log().matches(WAITING).count();
        let mut cmd = mbx(&h.home, &["mcp", "--as", &agent]);
        cmd.env("MBX_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = KillOnDrop(cmd.spawn().context("spawn agentmbx mcp")?);
        let mut stdin = child.0.stdin.take().context("mcp stdin")?;
        let stdout = child.0.stdout.take().context("mcp stdout")?;
        let (tx, lines) = std::sync::mpsc::channel::<(String, Instant)>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((line, Instant::now())).is_err() {
                    break;
                }
            }
        });
        // The next line the server writes that `pick` accepts, with the moment it was read.
        let next = |what: &str, pick: &dyn Fn(&Value) -> bool| -> Result<(Value, Instant)> {
            let deadline = Instant::now() + TIMEOUT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let (line, at) = lines
                    .recv_timeout(left)
                    .map_err(|_| anyhow::anyhow!("agentmbx mcp wrote no {what}"))?;
                let v: Value = serde_json::from_str(&line).context("a JSON-RPC line")?;
                if pick(&v) {
                    return Ok((v, at));
                }
            }
        };
        writeln!(
            stdin,
            "{}",
            json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "bench", "version": "0"}}})
        )?;
        stdin.flush()?;
        next("initialize answer", &|v| v["id"] == json!(0))?;
        writeln!(
            stdin,
            "{}",
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"})
        )?;
        stdin.flush()?;
        let deadline = Instant::now() + TIMEOUT;
        while h.daemon()?.log().matches(WAITING).count() <= waiting {
            if Instant::now() >= deadline {
                bail!("the channel watcher of {agent} did not start waiting within {TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let msg = json!({"from": "alice", "to": [agent], "kind": "request",
                         "subject": format!("wake-{run} {i}"), "body": body});
        let t0 = Instant::now();
        let (status, sent) = api.call("POST", "/v1/messages", Some(&msg))?;
        if status != 201 {
            bail!("send answered {status}: {sent}");
        }
        let (v, t1) = next("channel notification", &|v| {
            v["method"] == "notifications/claude/channel"
        })?;
        if v["params"]["meta"]["message_id"] != sent["id"] {
            bail!("the channel notification names another message: {v}");
        }
        lat.push(t1.duration_since(t0).as_secs_f64() * 1e3);
        drop(stdin);
        drop(child);
    }
    Ok(lat)
}

/// The position after the last message in `agent`'s inbox, acked ones included (the inbox
/// paged to its end): a wait from it answers only mail sent later.
fn inbox_end(api: &mut Api, agent: &str) -> Result<String> {
    let base = format!("/v1/inbox?as={agent}&all=true&limit=200");
    let mut path = base.clone();
    loop {
        let (status, page) = api.call("GET", &path, None)?;
        if status != 200 {
            bail!("inbox answered {status}: {page}");
        }
        match page["next_cursor"].as_str() {
            Some(next) => path = format!("{base}&cursor={next}"),
            None => return Ok(page["cursor"].as_str().context("cursor")?.to_string()),
        }
    }
}

/// `n` sends alice → bob on `h`, each answered by a long poll opened before it; the ms from
/// just before each send request to the waiter's answer.
fn long_polls(h: &mut Host, n: usize, run: usize) -> Result<Vec<f64>> {
    let body: String = (0..VALUE_BYTES)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let mut api = h.api()?;
    // Wait from the end of bob's inbox (earlier runs left mail in it).
    let mut cursor = inbox_end(&mut api, "bob")?;
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let waiting = h.daemon()?.log().matches(WAITING).count();
        let mut waiter = h.api()?;
        let path = format!("/v1/inbox?as=bob&wait=30&cursor={cursor}");
        let answer = std::thread::spawn(move || {
            let r = waiter.call("GET", &path, None);
            (r, Instant::now())
        });
        let deadline = Instant::now() + TIMEOUT;
        while h.daemon()?.log().matches(WAITING).count() <= waiting {
            if Instant::now() >= deadline {
                bail!("the long poll did not start waiting within {TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let msg = json!({"from": "alice", "to": ["bob"], "subject": format!("wait-{run} {i}"),
                         "body": body});
        let t0 = Instant::now();
        let (status, sent) = api.call("POST", "/v1/messages", Some(&msg))?;
        if status != 201 {
            bail!("send answered {status}: {sent}");
        }
        let (got, t1) = answer
            .join()
            .map_err(|_| anyhow::anyhow!("the waiter thread panicked"))?;
        let (status, page) = got?;
        if status != 200 || page["messages"][0]["id"] != sent["id"] {
            bail!("the long poll answered {status}: {page}");
        }
        cursor = page["cursor"].as_str().context("cursor")?.to_string();
        lat.push(t1.duration_since(t0).as_secs_f64() * 1e3);
    }
    Ok(lat)
}

// ---------------------------------------------------------------------------------------------
// Idle footprint and start-up

/// CPU time and per-thread context switches of a process at one moment.
#[derive(Debug, Default)]
struct Counters {
    /// utime + stime of the whole process (clock ticks).
    ticks: u64,
    /// Per thread id: (thread name, voluntary, involuntary context switches).
    threads: HashMap<String, (String, u64, u64)>,
}

fn proc_counters(pid: u32) -> Result<Counters> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').context("stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks =
        f.get(11).context("utime")?.parse::<u64>()? + f.get(12).context("stime")?.parse::<u64>()?;
    let mut threads = HashMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        threads.insert(
            task.file_name().to_string_lossy().into_owned(),
            (
                field("Name:"),
                field("voluntary_ctxt_switches:").parse().unwrap_or(0),
                field("nonvoluntary_ctxt_switches:").parse().unwrap_or(0),
            ),
        );
    }
    Ok(Counters { ticks, threads })
}

/// Context switches between two snapshots: `(voluntary, involuntary, voluntary by thread
/// name)`. A thread born in between counts from zero; one that ended in between is missed
/// (its last counts are gone with it), so the figures are lower bounds.
fn switches_between(before: &Counters, after: &Counters) -> (u64, u64, HashMap<String, u64>) {
    let (mut vol, mut invol, mut by_name) = (0, 0, HashMap::new());
    for (tid, (name, v1, i1)) in &after.threads {
        let (v0, i0) = before
            .threads
            .get(tid)
            .map(|(_, v, i)| (*v, *i))
            .unwrap_or((0, 0));
        let dv = v1.saturating_sub(v0);
        vol += dv;
        invol += i1.saturating_sub(i0);
        *by_name.entry(name.clone()).or_insert(0) += dv;
    }
    (vol, invol, by_name)
}

/// A `/proc/<pid>/status` field in kB, as MiB.
fn status_mib(pid: u32, field: &str) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("{field} in /proc/{pid}/status"))?;
    let kb: f64 = line[field.len()..]
        .split_whitespace()
        .next()
        .context("value")?
        .parse()?;
    Ok(kb / 1024.0)
}

fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

fn idle(o: &Opts) -> Result<()> {
    let dir = o.dir.join("idle");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let relay = start_relay(&dir)?;
    for with_relay in [true, false] {
        let mut host = Host::init(&dir, if with_relay { "idlehost" } else { "idlelone" })?;
        if with_relay {
            host.set_relay(&relay)?;
        }
        host.start()?;
        if with_relay {
            host.daemon()?.wait_log("published the enc-key ad")?;
        }
        idle_window(o, &mut host, with_relay)?;
    }
    drop(relay);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Measures one idle daemon over the window and emits its figures.
fn idle_window(o: &Opts, host: &mut Host, with_relay: bool) -> Result<()> {
    let window = if o.quick { 10.0 } else { 60.0 };
    // Let start-up work (first relay pass, enrolment) finish before the window opens.
    std::thread::sleep(Duration::from_secs(2));
    let pid = host.daemon()?.pid();
    let hz = clock_ticks();
    let segment = window / o.runs as f64;
    let suffix = if with_relay { "" } else { "_norelay" };
    eprintln!(
        "idle{suffix}: {window} s window in {} segment(s), daemon pid {pid}",
        o.runs
    );
    let (mut rss, mut cpu, mut wake, mut invol) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut by_name_total: HashMap<String, u64> = HashMap::new();
    let window_start = Instant::now();
    for _ in 0..o.runs {
        let before = proc_counters(pid)?;
        let start = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(segment));
        let after = proc_counters(pid)?;
        let dt = start.elapsed().as_secs_f64();
        let (vol, inv, by_name) = switches_between(&before, &after);
        cpu.push(after.ticks.saturating_sub(before.ticks) as f64 / hz / dt * 100.0);
        wake.push(vol as f64 / dt);
        invol.push(inv as f64 / dt);
        for (name, n) in by_name {
            *by_name_total.entry(name).or_insert(0) += n;
        }
        rss.push(status_mib(pid, "VmRSS:")?);
    }
    let hwm = status_mib(pid, "VmHWM:")?;
    // VmRSS = RssAnon (heap, stacks, malloc arenas) + RssFile (mapped pages of the binary and
    // libraries, shared and reclaimable) + RssShmem (the SQLite -shm file).
    let rss_anon = status_mib(pid, "RssAnon:")?;
    let rss_file = status_mib(pid, "RssFile:")?;
    let elapsed = window_start.elapsed().as_secs_f64();
    let by_thread: Map<String, Value> = by_name_total
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| (name, json!(round3(n as f64 / elapsed))))
        .collect();
    let setup = if with_relay {
        "fresh host, relay configured (on its push stream), no peers, no traffic".to_string()
    } else {
        "fresh host, no relay, no peers, no traffic".to_string()
    };
    let extra = json!({
        "window_s": window,
        "segments": o.runs,
        "vm_hwm_mib": round3(hwm),
        "rss_anon_mib": round3(rss_anon),
        "rss_file_mib": round3(rss_file),
        "threads": threads(pid),
        "involuntary_switches_per_s": round3(median(&invol)),
        "wakeups_per_s_by_thread": by_thread,
        "setup": setup,
    });
    let what = if with_relay {
        "relay configured"
    } else {
        "no relay"
    };
    emit(
        &format!("daemon_idle{suffix}_rss_mib"),
        &format!("daemon idle RSS (VmRSS), {what}"),
        "MiB",
        &rss,
        extra.clone(),
    );
    emit(
        &format!("daemon_idle{suffix}_cpu_pct"),
        &format!("daemon idle CPU (utime+stime), {what}"),
        "% of one core",
        &cpu,
        extra.clone(),
    );
    emit(
        &format!("daemon_idle{suffix}_wakeups_per_s"),
        &format!("daemon idle wakeups (voluntary context switches, all threads), {what}"),
        "1/s",
        &wake,
        extra,
    );
    Ok(())
}

/// Starts a daemon on `home` with `NOTIFY_SOCKET` set; ms until its `READY=1` datagram.
fn time_to_ready(home: &Path, sock_path: &Path) -> Result<f64> {
    let _ = std::fs::remove_file(sock_path);
    let sock = UnixDatagram::bind(sock_path)?;
    sock.set_read_timeout(Some(TIMEOUT))?;
    let mut cmd = mbx(home, &["daemon", "--api-port", "0"]);
    cmd.env("NOTIFY_SOCKET", sock_path);
    let t0 = Instant::now();
    let mut proc = Proc::spawn("daemon", cmd)?;
    let mut buf = vec![0u8; 4096];
    let ms = loop {
        let n = sock
            .recv(&mut buf)
            .with_context(|| format!("no READY=1 within {TIMEOUT:?}:\n{}", proc.log()))?;
        let msg = String::from_utf8_lossy(&buf[..n]);
        if msg.lines().any(|l| l == "READY=1") {
            break t0.elapsed().as_secs_f64() * 1e3;
        }
    };
    proc.stop();
    let _ = std::fs::remove_file(sock_path);
    Ok(ms)
}

fn start(o: &Opts) -> Result<()> {
    let dir = o.dir.join("start");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("notify.sock");
    let (mut fresh, mut existing) = (Vec::new(), Vec::new());
    for run in 0..o.runs {
        let home = dir.join(format!("home{run}"));
        fresh.push(time_to_ready(&home, &sock)?);
        existing.push(time_to_ready(&home, &sock)?);
    }
    let extra = json!({"signal": "READY=1 on NOTIFY_SOCKET (sd-notify)", "no_relay": true});
    emit(
        "daemon_cold_start_ms",
        "daemon start to READY=1, fresh home (creates the host key and store)",
        "ms",
        &fresh,
        extra.clone(),
    );
    emit(
        "daemon_start_existing_ms",
        "daemon start to READY=1, existing home",
        "ms",
        &existing,
        extra,
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Report

/// One target: `(name, numerator, denominator or None, comparison, threshold)`; an id, or
/// `id:key` for a number in that figure's `extra`.
/// With a denominator the value is the ratio of the two medians.
type Target = (
    &'static str,
    &'static str,
    Option<&'static str>,
    &'static str,
    f64,
);

const TARGETS: &[Target] = &[
    (
        "relay accepts, batch 20 / Redis XADD c50",
        "relay_accept_batch20",
        Some("redis_xadd_c50"),
        ">=",
        1.2,
    ),
    (
        "relay accepts, batch 1 / Redis XADD c50",
        "relay_accept_batch1",
        Some("redis_xadd_c50"),
        ">=",
        0.5,
    ),
    (
        "pull page latency, 1M / 1k queued",
        "relay_page_1m",
        Some("relay_page_1k"),
        "<=",
        2.0,
    ),
    (
        "items per fsync (batch 20)",
        "relay_accept_batch20:items_per_fsync",
        None,
        ">=",
        10.0,
    ),
    (
        "daemon idle RSS (MiB)",
        "daemon_idle_rss_mib",
        None,
        "<=",
        15.0,
    ),
    (
        "end-to-end via the relay on the push stream, p50 (ms)",
        "e2e_relay_p50",
        None,
        "<=",
        20.0,
    ),
    (
        "end-to-end via the relay on the push stream, p99 (ms)",
        "e2e_relay_p99",
        None,
        "<=",
        100.0,
    ),
    (
        "fail-over, LAN refuses: first message (ms)",
        "failover_refused_first_ms",
        None,
        "<=",
        3000.0,
    ),
    (
        "fail-over, LAN hangs: first message (ms)",
        "failover_hung_first_ms",
        None,
        "<=",
        3000.0,
    ),
    (
        "fail-over, LAN hangs: next 20, max (ms)",
        "failover_hung_next_max",
        None,
        "<=",
        100.0,
    ),
    (
        "daemon idle wakeups, relay configured (1/s)",
        "daemon_idle_wakeups_per_s",
        None,
        "<",
        1.0,
    ),
    (
        "relay memory per idle stream (KiB)",
        "relay_streams_kib_per_stream",
        None,
        "<=",
        16.0,
    ),
];

/// Which figure each issue figure number covers, for the table's first column.
fn figure_of(id: &str) -> &'static str {
    match id {
        s if s.starts_with("disk_") => "limit",
        s if s.starts_with("redis_") => "baseline",
        s if s.starts_with("floor_") => "floor",
        s if s.starts_with("relay_accept") => "1",
        s if s.starts_with("relay_pull") => "2",
        s if s.starts_with("relay_page") => "3",
        s if s.starts_with("e2e_") => "4",
        s if s.starts_with("daemon_") => "5",
        s if s.starts_with("wait_mcp") => "7",
        s if s.starts_with("wait_") => "6",
        s if s.starts_with("wake_") => "8",
        s if s.starts_with("failover_") => "9",
        s if s.starts_with("relay_streams") => "10",
        _ => "",
    }
}

fn fmt_num(x: f64) -> String {
    if x.abs() >= 1000.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

fn report(o: &Opts) -> Result<()> {
    let input = o.input.as_ref().context("report needs --in FILE")?;
    let text = std::fs::read_to_string(input).with_context(|| format!("{}", input.display()))?;
    let mut figures: Vec<Map<String, Value>> = Vec::new();
    let mut seen = HashSet::new();
    for line in text.lines() {
        let Some(j) = line.strip_prefix("BENCH ") else {
            continue;
        };
        let Ok(Value::Object(m)) = serde_json::from_str::<Value>(j) else {
            eprintln!("NOTE: unreadable BENCH line: {line}");
            continue;
        };
        if let Some(id) = m.get("id").and_then(Value::as_str) {
            if seen.insert(id.to_string()) {
                figures.push(m);
            }
        }
    }
    let by_id: HashMap<String, &Map<String, Value>> = figures
        .iter()
        .filter_map(|m| Some((m.get("id")?.as_str()?.to_string(), m)))
        .collect();
    let num =
        |m: &Map<String, Value>, k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let redis50 = by_id.get("redis_xadd_c50").map(|m| num(m, "median"));

    let mut md = String::new();
    md.push_str("## Results\n\n");
    md.push_str("| fig | figure | id | median | min | max | unit | runs | × Redis c50 |\n");
    md.push_str("|---|---|---|---:|---:|---:|---|---:|---:|\n");
    for m in &figures {
        let id = m.get("id").and_then(Value::as_str).unwrap_or("");
        let unit = m.get("unit").and_then(Value::as_str).unwrap_or("");
        let ratio = match redis50 {
            Some(r) if id.starts_with("relay_accept") && r > 0.0 => {
                format!("{:.2}", num(m, "median") / r)
            }
            _ => String::new(),
        };
        md.push_str(&format!(
            "| {} | {} | `{id}` | {} | {} | {} | {unit} | {} | {ratio} |\n",
            figure_of(id),
            m.get("label").and_then(Value::as_str).unwrap_or(""),
            fmt_num(num(m, "median")),
            fmt_num(num(m, "min")),
            fmt_num(num(m, "max")),
            m.get("runs").and_then(Value::as_u64).unwrap_or(0),
        ));
    }
    md.push_str("\n## Targets (medians of the same run)\n\n");
    if o.quick {
        md.push_str(
            "With `--quick` every size is reduced (fewer requests and messages, a shorter idle \
             window, and far fewer than 1,000,000 items queued for the deep page): a smoke run, \
             not the figures.\n\n",
        );
    }
    md.push_str("| target | value | goal | verdict |\n|---|---:|---|---|\n");
    for (name, num_id, den_id, cmp, goal) in TARGETS {
        let value = |spec: &str| -> Option<f64> {
            match spec.split_once(':') {
                Some((id, key)) => by_id.get(id)?.get("extra")?.get(key)?.as_f64(),
                None => by_id.get(spec).map(|m| num(m, "median")),
            }
        };
        let v = match den_id {
            Some(d) => value(num_id).zip(value(d)).map(|(a, b)| a / b),
            None => value(num_id),
        };
        let (shown, verdict) = match v {
            Some(v) if v.is_finite() => {
                let met = match *cmp {
                    ">=" => v >= *goal,
                    "<" => v < *goal,
                    _ => v <= *goal,
                };
                (fmt_num(v), if met { "met" } else { "**missed**" })
            }
            _ => ("—".to_string(), "not measured"),
        };
        md.push_str(&format!(
            "| {name} | {shown} | {cmp} {goal} | {verdict} |\n"
        ));
    }
    md.push_str("\n## Details (`extra` of each figure)\n\n");
    let mut previous: Option<&Value> = None;
    for m in &figures {
        let id = m.get("id").and_then(Value::as_str).unwrap_or("");
        let extra = m.get("extra");
        if extra.is_none_or(|e| e.as_object().is_some_and(|o| o.is_empty())) {
            continue;
        }
        if extra == previous {
            md.push_str(&format!("- `{id}`: as above\n"));
            continue;
        }
        previous = extra;
        if let Some(Value::Object(e)) = extra {
            if !e.is_empty() {
                let parts: Vec<String> = e.iter().map(|(k, v)| format!("{k}={v}")).collect();
                md.push_str(&format!("- `{id}`: {}\n", parts.join(", ")));
            }
        }
    }
    print!("{md}");
    if let Some(out) = &o.out {
        let mut doc = String::from("# Benchmarks\n\n");
        doc.push_str(
            "Latest numbers from `bench/run` (see \"How to run\" below). Every figure is the \
             median of the runs with min and max; every ratio compares medians measured in the \
             same run on the same machine.\n\n",
        );
        if let Some(machine) = &o.machine {
            doc.push_str("## Machine\n\n");
            doc.push_str(&std::fs::read_to_string(machine).unwrap_or_default());
            doc.push('\n');
        }
        doc.push_str(&md);
        doc.push_str(HOW_TO);
        doc.push_str(
            "\n## Raw lines\n\n<details><summary>BENCH lines of this run</summary>\n\n```\n",
        );
        for line in text.lines().filter(|l| l.starts_with("BENCH ")) {
            doc.push_str(line);
            doc.push('\n');
        }
        doc.push_str("```\n\n</details>\n");
        std::fs::write(out, doc).with_context(|| format!("write {}", out.display()))?;
    }
    Ok(())
}

/// The explanation appended to BENCHMARKS.md.
const HOW_TO: &str = include_str!("../../bench/README.md");
