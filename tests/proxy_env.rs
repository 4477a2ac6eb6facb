//! The standard proxy environment (`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`): relay calls go
//! through the proxy it names, unless `NO_PROXY` exempts the relay's host; LAN calls to peers
//! never do, whatever the environment says; nor do doctor's probes of the local API.
//!
//! A recorder on 127.0.0.1 stands in for the proxy and another for the direct destination; each
//! records the request line it received and answers 502 (the proxy) or 404 (the destination),
//! so nothing leaves loopback: a proxied request names `relay.invalid`, which is never resolved.
//! The environment is process-wide, so every case runs in this one test, in order, and the test
//! relies on nextest's process per test (under `cargo test`, run it alone).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentmbx::doctor;
use agentmbx::host_name::HostName;
use agentmbx::identity;
use agentmbx::keystore::{self, Backend};
use agentmbx::paths::Paths;
use agentmbx::transport::lan::client::LanClient;
use agentmbx::transport::relay_client::pin;
use agentmbx_protocol::clock::{SharedClock, SystemClock};

/// A loopback HTTP server that records each request line and answers with `status`.
struct Recorder {
    addr: String,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    fn start(status: &'static str) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind recorder");
        let addr = listener.local_addr().expect("recorder addr").to_string();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let seen = lines.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                let mut first = String::new();
                if reader.read_line(&mut first).is_err() {
                    continue;
                }
                // The rest of the head; bodies are not needed.
                loop {
                    let mut line = String::new();
                    match reader.read_line(&mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) if line == "\r\n" => break,
                        Ok(_) => {}
                    }
                }
                seen.lock()
                    .expect("lock")
                    .push(first.trim_end().to_string());
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
            }
        });
        Recorder { addr, lines }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("lock").clone()
    }

    /// Waits (up to 10 s) until `n` request lines were recorded, then returns them.
    fn wait_for(&self, n: usize) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let lines = self.lines();
            if lines.len() >= n || Instant::now() > deadline {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

const PROXY_VARS: [&str; 8] = [
    "HTTP_PROXY",
    "http_proxy",
    "HTTPS_PROXY",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
];

fn set_env(vars: &[(&str, &str)]) {
    for v in PROXY_VARS {
        std::env::remove_var(v);
    }
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
}

#[tokio::test]
async fn relay_calls_honour_the_proxy_environment_and_lan_calls_never_use_it() {
    agentmbx::install_tls_provider();
    let proxy = Recorder::start("502 Bad Gateway");
    let origin = Recorder::start("404 Not Found");
    let proxy_url = format!("http://{}", proxy.addr);

    // HTTP_PROXY, plain http relay URL: the proxy gets the absolute-form request and the relay's
    // name is never resolved here.
    set_env(&[("HTTP_PROXY", &proxy_url)]);
    let res = pin::fetch_info("http://relay.invalid:7374/").await;
    assert!(res.is_err(), "the proxy answered 502");
    assert_eq!(
        proxy.wait_for(1),
        vec!["GET http://relay.invalid:7374/v2/relay/info HTTP/1.1".to_string()]
    );

    // HTTPS_PROXY, https relay URL: a CONNECT tunnel to the relay's host and port.
    set_env(&[("HTTPS_PROXY", &proxy_url)]);
    let res = pin::fetch_info("https://relay.invalid").await;
    assert!(res.is_err(), "the proxy refused the tunnel");
    assert_eq!(
        proxy.wait_for(2)[1..],
        ["CONNECT relay.invalid:443 HTTP/1.1".to_string()]
    );

    // Loopback is not exempt by itself: a relay on 127.0.0.1 goes through the proxy too...
    set_env(&[("HTTP_PROXY", &proxy_url)]);
    let relay_url = format!("http://{}", origin.addr);
    let _ = pin::fetch_info(&relay_url).await;
    assert_eq!(
        proxy.wait_for(3)[2..],
        [format!("GET {relay_url}/v2/relay/info HTTP/1.1")]
    );
    assert!(origin.lines().is_empty());

    // ...unless NO_PROXY names it: then the relay is called directly (origin-form).
    set_env(&[("HTTP_PROXY", &proxy_url), ("NO_PROXY", "127.0.0.1")]);
    let _ = pin::fetch_info(&relay_url).await;
    assert_eq!(
        origin.wait_for(1),
        vec!["GET /v2/relay/info HTTP/1.1".to_string()]
    );
    assert_eq!(
        proxy.lines().len(),
        3,
        "the exempt call did not reach the proxy"
    );

    // The LAN client ignores every proxy variable: the peer gets the request directly.
    set_env(&[
        ("HTTP_PROXY", &proxy_url),
        ("HTTPS_PROXY", &proxy_url),
        ("ALL_PROXY", &proxy_url),
    ]);
    let home = tempfile::tempdir().expect("tempdir");
    let paths = Paths::at(home.path());
    let store = keystore::open_backend(&paths, Backend::File).expect("file key store");
    let name = HostName::parse("proxytest").expect("host name");
    let ident = identity::init_with(&paths, Some(&name), &*store).expect("init");
    let clock: SharedClock = Arc::new(SystemClock::with_offset(0));
    let lan = LanClient::new(Arc::new(ident), clock, 7373).expect("LAN client");
    let (status, _) = lan
        .call(reqwest::Method::GET, &origin.addr, "/v1/status", Vec::new())
        .await
        .expect("direct LAN call");
    assert_eq!(status, 404, "the peer itself answered");
    assert_eq!(
        origin.wait_for(2)[1..],
        ["GET /v1/status HTTP/1.1".to_string()]
    );
    assert_eq!(
        proxy.lines().len(),
        3,
        "the LAN call did not reach the proxy"
    );

    // Doctor's daemon check calls the local API directly, with every proxy variable set: the
    // recorder standing in for the API sees `GET /v1/health`, the proxy nothing.
    std::fs::write(paths.api_addr_file(), &origin.addr).expect("api.addr");
    let selected = doctor::select(&["daemon".to_string()]).expect("daemon check");
    let opts = doctor::Options {
        fix: false,
        timeout: Duration::from_secs(2),
        now_ms: 0,
    };
    let report = doctor::run(paths.clone(), &selected, opts).await;
    assert_eq!(
        origin.wait_for(3)[2..],
        ["GET /v1/health HTTP/1.1".to_string()]
    );
    assert_eq!(
        proxy.lines().len(),
        3,
        "the local API probe did not reach the proxy"
    );
    let check = &report.checks[0];
    assert_eq!(check.status, doctor::Status::Fail, "{check:?}");
    assert!(check.summary.contains("answered HTTP 404"), "{check:?}");
    set_env(&[]);
}
