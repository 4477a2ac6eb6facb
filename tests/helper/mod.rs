//! Fixtures for black-box tests: run the real `agentmbx` binary in a temporary home, start a
//! daemon as a child process, wait for conditions, and talk HTTP to it.
//!
//! Every child gets its own temporary `MBX_HOME`, `MBX_NO_MDNS=1`, `MBX_LOG=info` and none of
//! the caller's other `MBX_*` variables; daemons bind 127.0.0.1 port 0 and their port is read
//! from the `local API listening on <addr>` log line. Waiting is always polling a condition
//! under the one [`TIMEOUT`], never a bare sleep. Children are killed when their handle drops.

pub mod mesh;
pub mod relay_cli;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The one global timeout for anything a test waits for.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Pause between two checks of a polled condition.
pub const POLL: Duration = Duration::from_millis(20);

/// The log line prefix that announces the local API's bound address.
pub const LISTENING: &str = "local API listening on ";
/// The daemon's LAN server announcement (followed by the bound address).
pub const LAN_LISTENING: &str = "LAN server listening on ";

/// The log line prefix that announces a relay's bound address.
pub const RELAY_LISTENING: &str = "relay listening on ";

/// The binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_agentmbx")
}

/// Polls `check` until it returns `Some`, or `None` once [`TIMEOUT`] has passed.
pub fn poll<T>(mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(value) = check() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(POLL);
    }
}

/// Polls `check` until it returns `Some`; panics naming `what` after [`TIMEOUT`].
pub fn wait_for<T>(what: &str, check: impl FnMut() -> Option<T>) -> T {
    poll(check).unwrap_or_else(|| panic!("timed out after {TIMEOUT:?} waiting for {what}"))
}

/// A temporary host home. The directory `MBX_HOME` points at does not exist until the binary
/// creates it.
pub struct Home {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Home {
    /// A fresh, empty home.
    pub fn new() -> Home {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("home");
        Home { _dir: dir, path }
    }

    /// The `MBX_HOME` directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A file in the home.
    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Writes `config.toml` (creating the home).
    pub fn write_config(&self, text: &str) {
        std::fs::create_dir_all(&self.path).expect("create home");
        std::fs::write(self.file("config.toml"), text).expect("write config.toml");
    }

    /// The local API token the daemon created.
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.file("api.token"))
            .expect("read api.token")
            .trim()
            .to_string()
    }

    /// `agentmbx <args>` with a clean environment for this home.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = command(args);
        cmd.env("MBX_HOME", &self.path);
        cmd
    }

    /// Runs `agentmbx <args>` to completion (killed after [`TIMEOUT`]).
    pub fn run(&self, args: &[&str]) -> Output {
        run(self.command(args))
    }

    /// `agentmbx send --as alice --to bob --subject <subject> -m <body> --json <extra…>`
    /// through this home's daemon; asserts it succeeded and returns the message id.
    pub fn send_json(&self, subject: &str, body: &str, extra: &[&str]) -> String {
        let mut args = vec![
            "send",
            "--as",
            "alice",
            "--to",
            "bob",
            "--subject",
            subject,
            "-m",
            body,
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = self.run(&args);
        out.assert_success();
        out.json()["id"]
            .as_str()
            .expect("send --json gives the id")
            .to_string()
    }
}

/// `agentmbx <args>` with none of the caller's `MBX_*` variables (nor `PORT`), `MBX_NO_MDNS=1`,
/// keys in 0600 files (`MBX_KEYSTORE=file`: never the desktop's keyring), the LAN server on
/// 127.0.0.1 port 0 (`MBX_LAN_BIND`, `MBX_LAN_PORT`) and `MBX_LOG=info`.
pub fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(bin());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("MBX_") || name == "PORT" {
            cmd.env_remove(name);
        }
    }
    cmd.env("MBX_NO_MDNS", "1")
        .env("MBX_KEYSTORE", "file")
        .env("MBX_LAN_BIND", "127.0.0.1")
        .env("MBX_LAN_PORT", "0")
        .env("MBX_LOG", "info")
        .args(args)
        .stdin(Stdio::null());
    cmd
}

/// What a finished command printed, and how it ended.
#[derive(Debug)]
pub struct Output {
    /// Exit status.
    pub status: ExitStatus,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Output {
    /// The exit code (None when killed by a signal).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Panics with both streams unless the command succeeded.
    pub fn assert_success(&self) -> &Self {
        assert!(self.status.success(), "command failed: {self:#?}");
        self
    }

    /// Standard output parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }
}

/// Collects a child's stream into a shared string on a background thread.
fn collect(stream: impl Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = Arc::clone(&text);
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let mut text = sink.lock().expect("output lock");
            text.push_str(&line);
            text.push('\n');
        }
    });
    text
}

fn snapshot(text: &Arc<Mutex<String>>) -> String {
    text.lock().expect("output lock").clone()
}

/// Runs `cmd` to completion; kills it and panics after [`TIMEOUT`].
pub fn run(mut cmd: Command) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn agentmbx");
    let stdout = collect(child.stdout.take().expect("stdout"));
    let stderr = collect(child.stderr.take().expect("stderr"));
    let status = poll(|| child.try_wait().expect("try_wait"));
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "command did not finish within {TIMEOUT:?}; stderr:\n{}",
            snapshot(&stderr)
        );
    };
    // The pipes close when the process exits; wait for the readers to see EOF.
    let _ = poll(|| Arc::strong_count(&stdout).eq(&1).then_some(()));
    let _ = poll(|| Arc::strong_count(&stderr).eq(&1).then_some(()));
    Output {
        status,
        stdout: snapshot(&stdout),
        stderr: snapshot(&stderr),
    }
}

/// A daemon that exited before it announced its API.
#[derive(Debug)]
pub struct Exited {
    /// How it ended.
    pub status: ExitStatus,
    /// Everything it wrote on stderr.
    pub stderr: String,
}

/// A running `agentmbx daemon`, killed on drop.
pub struct Daemon {
    child: Child,
    stderr: Arc<Mutex<String>>,
    /// The local API's bound address, from the log line.
    pub addr: SocketAddr,
}

impl Daemon {
    /// Starts `agentmbx daemon --api-port 0` in `home` and waits until it listens.
    pub fn start(home: &Home) -> Daemon {
        Daemon::try_start(home.command(&["daemon", "--api-port", "0"]))
            .unwrap_or_else(|e| panic!("daemon exited before listening: {e:#?}"))
    }

    /// Starts `cmd` (a `daemon` command) and waits for its `local API listening on` line.
    /// `Err` when the process exits first; panics after [`TIMEOUT`].
    pub fn try_start(cmd: Command) -> Result<Daemon, Exited> {
        Daemon::spawn(cmd, LISTENING)
    }

    /// Starts `cmd` and waits for a log line `<announce><addr>` (e.g. [`RELAY_LISTENING`]).
    /// `Err` when the process exits first; panics after [`TIMEOUT`].
    pub fn spawn(mut cmd: Command, announce: &str) -> Result<Daemon, Exited> {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn agentmbx daemon");
        let stderr = collect(child.stderr.take().expect("stderr"));
        let outcome = poll(|| {
            if let Some(addr) = announced_addr(&snapshot(&stderr), announce) {
                return Some(Ok(addr));
            }
            child.try_wait().expect("try_wait").map(Err)
        });
        match outcome {
            Some(Ok(addr)) => Ok(Daemon {
                child,
                stderr,
                addr,
            }),
            Some(Err(status)) => {
                let _ = poll(|| Arc::strong_count(&stderr).eq(&1).then_some(()));
                Err(Exited {
                    status,
                    stderr: snapshot(&stderr),
                })
            }
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "process did not log {announce:?} within {TIMEOUT:?}; stderr:\n{}",
                    snapshot(&stderr)
                );
            }
        }
    }

    /// Everything the daemon has written on stderr so far.
    pub fn stderr(&self) -> String {
        snapshot(&self.stderr)
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `GET path`, with a bearer token when given.
    pub fn get(&self, path: &str, bearer: Option<&str>) -> HttpResponse {
        http(self.addr, "GET", path, bearer)
    }

    /// Waits until stderr contains `needle`; panics with the log when the process exits first
    /// or after [`TIMEOUT`].
    pub fn wait_for_stderr(&mut self, needle: &str) {
        let found = poll(|| {
            if self.stderr().contains(needle) {
                return Some(true);
            }
            self.child.try_wait().expect("try_wait").map(|_| false)
        });
        match found {
            Some(true) => {}
            Some(false) => {
                let _ = poll(|| Arc::strong_count(&self.stderr).eq(&1).then_some(()));
                panic!(
                    "process exited before logging {needle:?}; stderr:\n{}",
                    self.stderr()
                )
            }
            None => panic!(
                "timed out after {TIMEOUT:?} waiting for {needle:?}; stderr:\n{}",
                self.stderr()
            ),
        }
    }

    /// Waits for the line `FAILPOINT <name> reached`.
    pub fn wait_for_failpoint(&mut self, name: &str) {
        self.wait_for_stderr(&format!("FAILPOINT {name} reached"));
    }

    /// SIGKILL: the process dies at once, wherever it is. Returns everything it logged.
    pub fn kill(mut self) -> String {
        self.child.kill().expect("SIGKILL");
        let status = self.child.wait().expect("wait");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL),
            "{status:?}"
        );
        let _ = poll(|| Arc::strong_count(&self.stderr).eq(&1).then_some(()));
        self.stderr()
    }

    /// Sends SIGTERM and waits for the process to exit.
    pub fn terminate(mut self) -> (ExitStatus, String) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM failed");
        let status = wait_for("the daemon to exit after SIGTERM", || {
            self.child.try_wait().expect("try_wait")
        });
        let _ = poll(|| Arc::strong_count(&self.stderr).eq(&1).then_some(()));
        (status, self.stderr())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The address in the first `LAN server listening on <addr>` line of `log`.
pub fn lan_addr(log: &str) -> Option<SocketAddr> {
    announced_addr(log, LAN_LISTENING)
}

/// The address in the first `local API listening on <addr>` line of `log`.
pub fn listening_addr(log: &str) -> Option<SocketAddr> {
    announced_addr(log, LISTENING)
}

/// The address in the first `<announce><addr>` line of `log`.
pub fn announced_addr(log: &str, announce: &str) -> Option<SocketAddr> {
    let line = log.lines().find(|l| l.contains(announce))?;
    let rest = &line[line.find(announce)? + announce.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// An HTTP answer.
#[derive(Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Header lines, names lowercased.
    pub headers: Vec<(String, String)>,
    /// Body text.
    pub body: String,
}

impl HttpResponse {
    /// The body parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {self:#?}"))
    }

    /// The first header named `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request without a body over a fresh connection (`Connection: close`), std only.
pub fn http(addr: SocketAddr, method: &str, path: &str, bearer: Option<&str>) -> HttpResponse {
    request(addr, method, path, bearer, &[], None)
}

/// One HTTP/1.1 request over a fresh connection (`Connection: close`), std only: extra
/// `headers`, and a JSON `body` when given. Like the CLI, it waits out a 429 `RATE_LIMIT` (the
/// local API's rate classes: nothing was done) and asks again, for up to [`TIMEOUT`]; tests
/// that look at the 429 itself use [`request_once`].
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let r = request_once(addr, method, path, bearer, headers, body);
        if r.status != 429 || Instant::now() >= deadline {
            return r;
        }
        let pause = serde_json::from_str::<serde_json::Value>(&r.body)
            .ok()
            .and_then(|v| v["retry_after"].as_f64())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map_or(POLL, |s| Duration::from_secs_f64(s.min(5.0)));
        std::thread::sleep(pause);
    }
}

/// One HTTP/1.1 request as [`request`], without waiting out a 429.
pub fn request_once(
    addr: SocketAddr,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).expect("connect to the daemon");
    stream
        .set_read_timeout(Some(TIMEOUT))
        .expect("read timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(token) = bearer {
        req.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    for (name, value) in headers {
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    let body = body.unwrap_or_default();
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(req.as_bytes()).expect("send request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read response");
    let text = String::from_utf8(raw).expect("response is UTF-8");
    let (head, body) = text
        .split_once("\r\n\r\n")
        .expect("response has a header block");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if size == 0 {
            break;
        }
        body.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    body
}

/// The Unix permission bits of a file.
#[cfg(unix)]
pub fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}
