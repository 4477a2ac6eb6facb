//! Relay memory per idle push stream (`GET /v2/relay/stream`, `docs/relay-stream.md`): opens N
//! idle streams (default 10,000) against a relay running as a separate process and prints how
//! much the relay's resident memory grew per stream, plus how long the relay takes to close
//! them all (1001) and exit on SIGTERM.
//!
//! `cargo bench -p agentmbx-relay --bench streams -- [--streams N] [--quick]`
//!
//! The relay is the `agentmbx` binary (`MBX_BENCH_BIN`, default `<target>/release/agentmbx`) as
//! `relay serve` on 127.0.0.1 over a fresh store directory (under `MBX_BENCH_DIR`, default the
//! system temporary directory). The N host keys are enrolled by writing the store directly
//! before the relay starts (enrolment over HTTP is rate-limited per address); every stream is
//! a real signed upgrade with a nonce from a signed info, then `resume` and its
//! `resume_complete`, so each stream is registered and live. The store's `relay.toml` raises
//! `max_connections` and the info rate limit; this process raises its own file-descriptor
//! limit (the relay inherits it), never the product's.
//!
//! Output: one line `BENCH {json}` per figure on stdout; progress on stderr. Nothing is
//! asserted: the target (≤ 16 KiB per stream) is for the report.
#![allow(clippy::unwrap_used, clippy::expect_used)] // A bench binary: a failure is a report.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use agentmbx_protocol::hop;
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::stream::STREAM_PATH;
use agentmbx_relay::store::{
    AuthorityStrength, DirectoryStore, EnrolOutcome, EnrolRequest, OpenOptions, SqliteStore,
    StoreHealth,
};

type Res<T> = Result<T, String>;

/// Streams opened before the baseline is read (allocator arenas and buffers warmed up).
const WARM_UP: usize = 200;

/// Streams being opened at once.
const CONCURRENCY: usize = 64;

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut n = 10_000usize;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--quick" => n = 1_000,
            "--streams" => {
                i += 1;
                n = args
                    .get(i)
                    .and_then(|v| v.parse().ok())
                    .filter(|n| *n > 0)
                    .unwrap_or_else(|| fail("--streams needs a positive number"));
            }
            _ => {}
        }
        i += 1;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Err(e) = rt.block_on(run(n)) {
        fail(&e);
    }
}

fn fail(why: &str) -> ! {
    eprintln!("bench streams: {why}");
    std::process::exit(1)
}

fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis(),
    )
    .unwrap_or(i64::MAX)
}

/// Raises this process's open-file limit to `want` (at most the hard limit); the relay child
/// inherits it. Returns the soft limit now in force.
fn raise_nofile(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    #[allow(unsafe_code)]
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        let target = want.min(lim.rlim_max);
        if lim.rlim_cur < target {
            lim.rlim_cur = target;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        }
    }
    lim.rlim_cur
}

/// `VmRSS` of `pid` in KiB.
fn rss_kib(pid: u32) -> Res<u64> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "no VmRSS".to_owned())
}

struct Host {
    name: String,
    key: HostKey,
}

struct Relay {
    child: Child,
    base: String,
    addr: String,
    pid: u32,
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn binary() -> Res<PathBuf> {
    let bin = match std::env::var_os("MBX_BENCH_BIN") {
        Some(b) => PathBuf::from(b),
        None => {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            exe.parent()
                .and_then(Path::parent)
                .ok_or("cannot find the target directory")?
                .join("agentmbx")
        }
    };
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "{} not found: build it with `cargo build --release -p agentmbx` or set MBX_BENCH_BIN",
            bin.display()
        ))
    }
}

/// Enrols `hosts` by writing the store in `dir` directly (no relay runs on it yet).
fn seed(dir: &Path, key: &HostKey, hosts: &[Host]) -> Res<()> {
    let st = SqliteStore::open_with(
        dir,
        &key.public().to_b64(),
        now_ms(),
        OpenOptions {
            lock_wait_ms: 0,
            ..OpenOptions::default()
        },
    )
    .map_err(|e| format!("open the store: {e}"))?;
    for h in hosts {
        let out = st
            .enrol(EnrolRequest {
                host_pubkey: h.key.public().to_b64(),
                host_name: h.name.clone(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".into(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: now_ms(),
            })
            .map_err(|e| format!("enrol: {e}"))?;
        if !matches!(out, EnrolOutcome::Enrolled(_)) {
            return Err(format!("enrol {}: {out:?}", h.name));
        }
    }
    // The heartbeat, so the relay keeps the epoch at start.
    st.set_heartbeat(now_ms())
        .map_err(|e| format!("heartbeat: {e}"))?;
    Ok(())
}

async fn start(
    bin: &Path,
    dir: &Path,
    key: &HostKey,
    admin: &str,
    http: &reqwest::Client,
) -> Res<Relay> {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        l.local_addr().map_err(|e| e.to_string())?.port()
    };
    let log = std::fs::File::create(dir.join("relay.out")).map_err(|e| e.to_string())?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    let child = Command::new(bin)
        .args(["relay", "serve", "--bind", "127.0.0.1", "--port"])
        .arg(port.to_string())
        .arg("--store-dir")
        .arg(dir)
        .env("MBX_RELAY_KEY", key.seed_b64_secret())
        .env(agentmbx_relay::config::ADMIN_TOKEN_ENV, admin)
        .env("MBX_LOG", "warn")
        .env_remove("PORT")
        .env_remove("MBX_RELAY_DIR")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let pid = child.id();
    let mut relay = Relay {
        child,
        base: format!("http://127.0.0.1:{port}"),
        addr: format!("127.0.0.1:{port}"),
        pid,
    };
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(Some(status)) = relay.child.try_wait() {
            return Err(format!("the relay exited at start ({status})"));
        }
        let ok = http
            .get(format!("{}/v2/relay/info", relay.base))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return Ok(relay);
        }
        if Instant::now() > until {
            return Err("the relay did not answer within 120 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

type Socket = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// One live stream for `host`: signed info for a nonce, the signed upgrade, `resume` and its
/// `resume_complete`.
async fn open(http: &reqwest::Client, base: &str, addr: &str, host: &Host) -> Res<Socket> {
    let signed = |target: &str| {
        hop::sign_relay_hop(&host.key, &host.name, "GET", target, now_ms(), "").pairs()
    };
    let mut req = http.get(format!("{base}/v2/relay/info"));
    for (k, v) in signed("/v2/relay/info") {
        req = req.header(k, v);
    }
    let info: serde_json::Value = req
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let nonce = info["you"]["stream_nonce"]
        .as_str()
        .ok_or_else(|| format!("no stream nonce: {info}"))?;
    let target = format!("{STREAM_PATH}?nonce={nonce}");
    let mut ws_req = format!("ws://{addr}{target}")
        .into_client_request()
        .map_err(|e| e.to_string())?;
    for (k, v) in signed(&target) {
        ws_req
            .headers_mut()
            .insert(k, v.parse().map_err(|_| "header value".to_owned())?);
    }
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let (mut ws, _) = tokio_tungstenite::client_async(ws_req, tcp)
        .await
        .map_err(|e| format!("upgrade: {e}"))?;
    ws.send(Message::Text(
        json!({"type": "resume", "epoch": "", "after": 0})
            .to_string()
            .into(),
    ))
    .await
    .map_err(|e| e.to_string())?;
    loop {
        match tokio::time::timeout(Duration::from_secs(30), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) if t.as_str().contains("resume_complete") => {
                return Ok(ws)
            }
            Ok(Some(Ok(_))) => {}
            other => return Err(format!("no resume_complete: {other:?}")),
        }
    }
}

/// Keeps `ws` open like a daemon would: reads every frame and answers each `ping` with its
/// `pong`, so the relay's pong deadline never closes it. Returns the close code the relay
/// sent (`None` when the stream ended without one).
async fn hold(mut ws: Socket) -> Option<u16> {
    while let Some(Ok(msg)) = ws.next().await {
        match msg {
            Message::Text(t) => {
                let f: serde_json::Value = serde_json::from_str(t.as_str()).unwrap_or_default();
                if f["type"] == "ping" {
                    let pong = json!({"type": "pong", "id": f["id"]}).to_string();
                    if ws.send(Message::Text(pong.into())).await.is_err() {
                        return None;
                    }
                }
            }
            Message::Close(frame) => return frame.map(|f| u16::from(f.code)),
            _ => {}
        }
    }
    None
}

/// Opens one stream per host, [`CONCURRENCY`] at a time; each is then held by its own reader
/// task ([`hold`]).
async fn open_all(
    http: &reqwest::Client,
    relay: &Relay,
    hosts: &'static [Host],
) -> Res<Vec<tokio::task::JoinHandle<Option<u16>>>> {
    let mut out = Vec::with_capacity(hosts.len());
    for chunk in hosts.chunks(CONCURRENCY) {
        let mut set = tokio::task::JoinSet::new();
        for h in chunk {
            let (http, base, addr) = (http.clone(), relay.base.clone(), relay.addr.clone());
            set.spawn(async move { open(&http, &base, &addr, h).await });
        }
        while let Some(r) = set.join_next().await {
            out.push(tokio::spawn(hold(r.map_err(|e| e.to_string())??)));
        }
    }
    Ok(out)
}

/// Waits until the relay's admin stats count `want` open streams (at most 120 s).
async fn wait_open(http: &reqwest::Client, relay: &Relay, admin: &str, want: usize) -> Res<()> {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let stats: serde_json::Value = http
            .get(format!("{}/v2/relay/admin/stats", relay.base))
            .bearer_auth(admin)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        let open = stats["streams"]["open"].as_u64();
        if open == Some(want as u64) {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(format!("{open:?} streams open, {want} expected"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn run(n: usize) -> Res<()> {
    let bin = binary()?;
    let fds = raise_nofile(2 * (n + WARM_UP) as u64 + 4_096);
    if fds < (n + WARM_UP) as u64 + 1_024 {
        return Err(format!(
            "the open-file limit is {fds}: too low for {n} streams (raise the hard limit)"
        ));
    }
    let base = std::env::var_os("MBX_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("mbx-stream-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let _cleanup = Cleanup(dir.clone());
    std::fs::write(
        dir.join("relay.toml"),
        format!(
            "max_connections = {}\n[rate]\ninfo_per_min = 1000000\n",
            n + WARM_UP + 1_024
        ),
    )
    .map_err(|e| e.to_string())?;
    let key = HostKey::generate();
    let hosts: &'static [Host] = Box::leak(
        (0..n + WARM_UP)
            .map(|i| Host {
                name: format!("h{i}"),
                key: HostKey::generate(),
            })
            .collect::<Vec<_>>()
            .into_boxed_slice(),
    );
    let t = Instant::now();
    seed(&dir, &key, hosts)?;
    eprintln!(
        "bench streams: {} keys enrolled in the store in {:.1} s",
        hosts.len(),
        t.elapsed().as_secs_f64()
    );
    // No kept-alive connections: only the streams hold connections when RSS is read.
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| e.to_string())?;
    // The admin token (stats): a fresh random value for this run only.
    let admin = HostKey::generate().public().to_b64();
    let mut relay = start(&bin, &dir, &key, &admin, &http).await?;
    let idle = rss_kib(relay.pid)?;
    let warm = open_all(&http, &relay, &hosts[..WARM_UP]).await?;
    wait_open(&http, &relay, &admin, WARM_UP).await?;
    let before = rss_kib(relay.pid)?;
    let t = Instant::now();
    let streams = open_all(&http, &relay, &hosts[WARM_UP..]).await?;
    let opened_in = t.elapsed();
    // Every stream still open (its reader answers the pings) when RSS is read.
    wait_open(&http, &relay, &admin, n + WARM_UP).await?;
    let after = rss_kib(relay.pid)?;
    let per = (after.saturating_sub(before)) as f64 / n as f64;
    eprintln!(
        "bench streams: relay RSS {idle} KiB idle, {before} KiB with {WARM_UP} streams, {after} KiB \
         with {} ({:.1} s to open {n})",
        n + WARM_UP,
        opened_in.as_secs_f64()
    );
    println!(
        "BENCH {}",
        json!({"id": "relay-stream-rss", "label": "relay RSS growth per idle push stream",
               "unit": "KiB/stream", "median": per, "min": per, "max": per, "runs": 1,
               "extra": {"streams": n, "rss_before_kib": before, "rss_after_kib": after,
                         "rss_idle_kib": idle, "open_s": opened_in.as_secs_f64(),
                         "binary": bin.display().to_string()}})
    );
    // SIGTERM with every stream open: the relay closes them (1001) and exits.
    let t = Instant::now();
    // SAFETY: kill(2) on the pid of our own child, which has not been waited for.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(relay.pid as i32, libc::SIGTERM);
    }
    let status = tokio::task::spawn_blocking(move || {
        let s = relay.child.wait();
        (relay, s)
    })
    .await
    .map_err(|e| e.to_string())?;
    let stop_ms = t.elapsed().as_secs_f64() * 1_000.0;
    eprintln!(
        "bench streams: SIGTERM with {} streams open: exited ({:?}) in {stop_ms:.0} ms",
        n + WARM_UP,
        status.1.map(|s| s.code())
    );
    println!(
        "BENCH {}",
        json!({"id": "relay-stream-shutdown", "label": "relay exit on SIGTERM with every stream open",
               "unit": "ms", "median": stop_ms, "min": stop_ms, "max": stop_ms, "runs": 1,
               "extra": {"streams": n + WARM_UP}})
    );
    let mut going_away = 0usize;
    for h in warm.into_iter().chain(streams) {
        if h.await.map_err(|e| e.to_string())? == Some(1001) {
            going_away += 1;
        }
    }
    eprintln!(
        "bench streams: {going_away} of {} streams closed with 1001",
        n + WARM_UP
    );
    Ok(())
}

struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
