//! Fixtures for the relay's HTTP tests: the real server on 127.0.0.1 port 0 over a fresh
//! `SqliteStore` in a temporary directory ([`TestRelay`]), driven by a [`ManualClock`]; a small
//! client that signs v2 hops with `hop::sign_relay_hop`; and factories for host keys, enrolment,
//! sealed envelopes, receipt wires and enc-key ads.
//!
//! The clock only moves when a test moves it, so sequence numbers are predictable
//! (`seq = max(next_seq, now_ms)`) and hop timestamps can be placed exactly on the window edge.
#![allow(dead_code)] // Not every fixture has a test today (`HOP_HEADERS`, `Relay::store`).

use std::sync::Arc;

use serde_json::{json, Value};

use agentmbx_protocol::clock::{Clock, ManualClock};
use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::hop::{self, header};
use agentmbx_protocol::keys::{EncKey, HostKey, PublicKey};
use agentmbx_protocol::records::{self, EncAd, Receipt};
use agentmbx_protocol::{b64, seal, ulid};

use agentmbx_relay::config::{LimitsConfig, RelayConfig};
use agentmbx_relay::server::SharedRelay;
use agentmbx_relay::store::{self, RelayStore, StoreHealth};
use agentmbx_relay::testing::{TestRelay, TestRelayBuilder};

/// Where every relay clock starts: 2026-01-01T00:00:00.000Z.
pub const T0: i64 = 1_767_225_600_000;

/// A relay server running in this process ([`TestRelay`]), with an HTTP client for it.
pub struct Relay {
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// The relay's clock (hops are signed with its time unless a test says otherwise).
    pub clock: Arc<ManualClock>,
    /// The server state (store access for revocations, sender lists, inspection).
    pub state: SharedRelay,
    /// The relay's public key (accept statements verify against it).
    pub relay_pub: PublicKey,
    http: reqwest::Client,
    relay: TestRelay,
}

/// An HTTP answer: status, raw body and (when it parses) the JSON body.
#[derive(Debug, Clone)]
pub struct Resp {
    /// HTTP status code.
    pub status: u16,
    /// `content-type` header, "" when absent.
    pub content_type: String,
    /// The body as text.
    pub text: String,
    /// The body as JSON (`Value::Null` when it does not parse).
    pub json: Value,
}

impl Resp {
    /// `json[key]` as a string ("" when absent).
    pub fn str(&self, key: &str) -> &str {
        self.json.get(key).and_then(Value::as_str).unwrap_or("")
    }

    /// Asserts an error answer: `status`, JSON content type, `{error, code}` exactly.
    #[track_caller]
    pub fn assert_error(&self, status: u16, error: &str, code: &str) {
        assert_eq!(self.status, status, "{self:#?}");
        assert!(
            self.content_type.starts_with("application/json"),
            "{self:#?}"
        );
        assert_eq!(self.str("error"), error, "{self:#?}");
        assert_eq!(self.str("code"), code, "{self:#?}");
    }

    /// Asserts a 200 JSON answer.
    #[track_caller]
    pub fn assert_ok(&self) -> &Value {
        assert_eq!(self.status, 200, "{self:#?}");
        assert!(
            self.content_type.starts_with("application/json"),
            "{self:#?}"
        );
        &self.json
    }

    /// The per-item statuses of a push answer.
    #[track_caller]
    pub fn statuses(&self) -> Vec<String> {
        self.assert_ok()["results"]
            .as_array()
            .expect("results array")
            .iter()
            .map(|r| r["status"].as_str().expect("status text").to_owned())
            .collect()
    }

    /// The one per-item status of a single-item push answer.
    #[track_caller]
    pub fn status1(&self) -> String {
        let s = self.statuses();
        assert_eq!(s.len(), 1, "{self:#?}");
        s[0].clone()
    }
}

impl Relay {
    /// A relay with the default (published) limits.
    pub async fn start() -> Relay {
        Relay::start_with(LimitsConfig::default()).await
    }

    /// A relay with the given limits.
    pub async fn start_with(limits: LimitsConfig) -> Relay {
        Relay::start_with_config(RelayConfig {
            limits,
            ..RelayConfig::default()
        })
        .await
    }

    /// A relay with the given configuration.
    pub async fn start_with_config(config: RelayConfig) -> Relay {
        Relay::start_wrapped(config, |s| s).await
    }

    /// A relay whose store can be made to report a failure ([`FailingStore::fail`]), as the
    /// SQLite store does after a failed COMMIT.
    pub async fn start_failing() -> (Relay, Arc<FailingStore>) {
        Relay::start_failing_with_config(RelayConfig::default()).await
    }

    /// [`Relay::start_failing`] with the given configuration.
    pub async fn start_failing_with_config(config: RelayConfig) -> (Relay, Arc<FailingStore>) {
        let slot = Arc::new(std::sync::Mutex::new(None));
        let wrapped = slot.clone();
        let relay = Relay::start_wrapped(config, move |inner| {
            let f = Arc::new(FailingStore {
                inner,
                failure: std::sync::Mutex::new(None),
                on_read: std::sync::Mutex::new(None),
                epoch_reads_fail: std::sync::atomic::AtomicBool::new(false),
            });
            *wrapped.lock().expect("slot") = Some(f.clone());
            f
        })
        .await;
        let faulty = slot.lock().expect("slot").take().expect("wrapped");
        (relay, faulty)
    }

    /// A relay with the given configuration over the SQLite store as `wrap` returns it.
    pub async fn start_wrapped(
        config: RelayConfig,
        wrap: impl FnOnce(Arc<dyn RelayStore>) -> Arc<dyn RelayStore> + Send + 'static,
    ) -> Relay {
        let clock = Arc::new(ManualClock::new(T0));
        Relay::serve(
            TestRelay::builder()
                .clock(clock.clone())
                .config(config)
                .wrap_store(wrap),
            clock,
        )
        .await
    }

    /// Starts `relay` (whose clock is `clock`) and a client for it.
    async fn serve(relay: TestRelayBuilder, clock: Arc<ManualClock>) -> Relay {
        let relay = relay.start().await;
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(std::time::Duration::from_secs(60))
            .build()
            .expect("http client");
        Relay {
            base: relay.url().to_owned(),
            clock,
            state: relay.state().clone(),
            relay_pub: relay.pubkey(),
            http,
            relay,
        }
    }

    /// Stops the server gracefully and checks that `serve` returned `Ok`.
    pub async fn stop(self) {
        self.relay.stop().await.expect("serve returned an error");
    }

    /// Waits (up to 30 s) for the server to stop on its own, without asking it to, and returns
    /// what `serve` returned.
    pub async fn stopped(self) -> std::io::Result<()> {
        self.relay.stopped(std::time::Duration::from_secs(30)).await
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_owned()
    }

    /// The relay clock's time.
    pub fn now(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The store (blocking calls; fine from a test for one-off inspection or setup).
    pub fn store(&self) -> Arc<dyn RelayStore> {
        self.relay.store()
    }

    /// Runs a blocking store call off the runtime.
    pub async fn with_store<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn RelayStore) -> T + Send + 'static,
    ) -> T {
        self.relay.with_store(f).await
    }

    /// The current epoch (from the store).
    pub async fn epoch(&self) -> String {
        self.relay.epoch().await
    }

    /// Sends a raw request: any method, target, headers and body bytes.
    pub async fn send(
        &self,
        method: &str,
        target: &str,
        headers: &[(String, String)],
        body: Vec<u8>,
    ) -> Resp {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut req = self
            .http
            .request(method, format!("{}{target}", self.base))
            .body(body);
        for (k, v) in headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let res = req.send().await.expect("http request");
        Resp::read(res).await
    }

    /// An unsigned request with a JSON (or any text) body.
    pub async fn plain(&self, method: &str, target: &str, body: &str) -> Resp {
        let ct = vec![("content-type".to_owned(), "application/json".to_owned())];
        self.send(method, target, &ct, body.as_bytes().to_vec())
            .await
    }

    /// A v2 hop signed by `host` at the relay's time.
    pub async fn hop(&self, host: &Host, method: &str, target: &str, body: &str) -> Resp {
        self.hop_at(host, method, target, body, self.now()).await
    }

    /// A v2 hop signed by `host` with timestamp `ts_ms`.
    pub async fn hop_at(
        &self,
        host: &Host,
        method: &str,
        target: &str,
        body: &str,
        ts_ms: i64,
    ) -> Resp {
        let headers = host.hop_headers(method, target, body, ts_ms);
        self.send(method, target, &headers, body.as_bytes().to_vec())
            .await
    }

    /// Challenge + enrol over HTTP; asserts both succeed.
    pub async fn enrol(&self, host: &Host) {
        let r = self.enrol_try(host).await;
        assert_eq!(r.json, json!({"ok": true}), "{r:#?}");
        assert_eq!(r.status, 200, "{r:#?}");
    }

    /// Challenge + enrol over HTTP; returns the enrol answer.
    pub async fn enrol_try(&self, host: &Host) -> Resp {
        let challenge = self.challenge(host).await;
        self.plain("POST", "/v1/relay/enrol", &host.enrol_body(&challenge))
            .await
    }

    /// Asks for a challenge for `host`; asserts success and returns it.
    pub async fn challenge(&self, host: &Host) -> String {
        let body = json!({"host": host.name, "pubkey": host.pubkey()}).to_string();
        let r = self.plain("POST", "/v1/relay/challenge", &body).await;
        r.assert_ok();
        let c = r.str("challenge").to_owned();
        assert!(!c.is_empty(), "{r:#?}");
        c
    }

    /// Enrols `host` straight through the store (no HTTP): for bulk targets.
    pub async fn enrol_direct(&self, host: &Host) {
        let req = store::EnrolRequest {
            host_pubkey: host.pubkey(),
            host_name: host.name.clone(),
            owner_fp: String::new(),
            account: None,
            authorized_by: "host-key-challenge".into(),
            strength: store::AuthorityStrength::HostKeyChallenge,
            now_ms: self.now(),
        };
        let out = self.with_store(move |s| s.enrol(req)).await;
        assert!(
            matches!(out, Ok(store::EnrolOutcome::Enrolled(_))),
            "{out:?}"
        );
    }

    /// Revokes `host` through the store.
    pub async fn revoke(&self, host: &Host) {
        let pk = host.pubkey();
        let now = self.now();
        let out = self.with_store(move |s| s.revoke(&pk, now)).await;
        assert!(matches!(out, Ok(store::RevokeOutcome::Revoked)), "{out:?}");
    }

    /// `POST /v2/relay/items {items}` signed by `host`.
    pub async fn push(&self, host: &Host, items: Vec<Value>) -> Resp {
        let body = json!({ "items": items }).to_string();
        self.hop(host, "POST", "/v2/relay/items", &body).await
    }

    /// `GET /v2/relay/items?<query>` signed by `host` ("" for no query).
    pub async fn pull(&self, host: &Host, query: &str) -> Resp {
        let target = if query.is_empty() {
            "/v2/relay/items".to_owned()
        } else {
            format!("/v2/relay/items?{query}")
        };
        self.hop(host, "GET", &target, "").await
    }

    /// `POST /v2/relay/ack {epoch, through}` signed by `host`.
    pub async fn ack(&self, host: &Host, epoch: &str, through: Value) -> Resp {
        let body = json!({"epoch": epoch, "through": through}).to_string();
        self.hop(host, "POST", "/v2/relay/ack", &body).await
    }

    /// Runs one retention sweep now, at the relay clock's time, as the server's schedule does
    /// (`agentmbx_relay::retention::sweep_once`); panics when it fails.
    pub async fn sweep(&self) -> store::SweepReport {
        self.relay.sweep().await.expect("retention sweep")
    }

    /// Pulls `host`'s whole queue (one page of up to 500) and returns the item ids in order.
    pub async fn queue_ids(&self, host: &Host) -> Vec<String> {
        let r = self.pull(host, "after=0&limit=500").await;
        r.assert_ok()["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|i| i["item_id"].as_str().expect("item id").to_owned())
            .collect()
    }
}

impl Resp {
    async fn read(res: reqwest::Response) -> Resp {
        let status = res.status().as_u16();
        let content_type = res
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let text = res.text().await.expect("response body");
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Resp {
            status,
            content_type,
            text,
            json,
        }
    }
}

/// A host: its signing key, enc key and name.
pub struct Host {
    /// Host name (a label on the relay).
    pub name: String,
    /// Ed25519 host key.
    pub key: HostKey,
    /// X25519 enc key.
    pub enc: EncKey,
}

impl Host {
    /// A fresh host called `name`.
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

    /// v2 hop headers for a request.
    pub fn hop_headers(
        &self,
        method: &str,
        target: &str,
        body: &str,
        ts_ms: i64,
    ) -> Vec<(String, String)> {
        let h = hop::sign_relay_hop(&self.key, &self.name, method, target, ts_ms, body);
        let mut v: Vec<(String, String)> = h
            .pairs()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        v.push(("content-type".into(), "application/json".into()));
        v
    }

    /// The enrol body for a challenge (owner_fp "").
    pub fn enrol_body(&self, challenge: &str) -> String {
        let pk = self.pubkey();
        let sig = self
            .key
            .sign(records::enrol_canonical(challenge, &self.name, &pk, "").as_bytes());
        json!({"host": self.name, "pubkey": pk, "owner_fp": "", "sig": sig}).to_string()
    }

    /// A signed v2 enc-key ad issued at `now_ms`: `(ad, sig)`.
    pub fn enc_ad(&self, now_ms: i64) -> (Value, String) {
        let ad = EncAd::new(
            &self.name,
            &self.key.public(),
            &self.enc.public().to_b64(),
            now_ms,
        );
        (ad.to_value(), ad.sign(&self.key))
    }
}

/// A fresh ULID for `now_ms`.
pub fn new_id(now_ms: i64) -> String {
    ulid::Generator::new().next(now_ms)
}

/// A plain (unsealed, host-signed) envelope from `from` to `to`.
pub fn plain_envelope(from: &Host, to: &Host, body: &str, now_ms: i64) -> envelope::Envelope {
    let id = new_id(now_ms);
    let draft = Draft {
        from: format!("agent@{}", from.name),
        to: vec![format!("agent@{}", to.name)],
        subject: "hello".into(),
        body: body.into(),
        ..Draft::default()
    };
    let mut env = envelope::build(&draft, id, now_ms).expect("build envelope");
    env.sign(&from.name, &from.key).expect("sign envelope");
    env
}

/// A sealed envelope from `from` for `to`: `(id, wire JSON text)`.
pub fn sealed_wire(from: &Host, to: &Host, body: &str, now_ms: i64) -> (String, String) {
    let plain = plain_envelope(from, to, body, now_ms);
    let sealed = seal::seal_envelope(&plain, &to.enc.public(), &from.name, &from.key)
        .expect("seal envelope");
    (sealed.id.clone(), sealed.wire_json())
}

/// A receipt wire signed by `signer` (the recipient host): `(item id, wire text)`.
pub fn receipt_wire(signer: &Host, msg: &str, seq: u64, now_ms: i64) -> (String, String) {
    let rec = receipt(signer, msg, seq, now_ms);
    (rec.item_id(), rec.wire(&signer.key).expect("receipt wire"))
}

/// A T218 receipt record from `signer`.
pub fn receipt(signer: &Host, msg: &str, seq: u64, now_ms: i64) -> Receipt {
    Receipt {
        v: 1,
        kind: "receipt".into(),
        msg: msg.into(),
        recipient: format!("agent@{}", signer.name),
        state: "delivered".into(),
        at: agentmbx_protocol::time::iso_ms(now_ms),
        note: None,
        did: None,
        seq,
    }
}

/// One push item `{kind, item_id, targets:[{host_pubkey, wire_b64}]}` with raw wire bytes.
pub fn item(kind: &str, item_id: &str, targets: &[(&Host, &[u8])]) -> Value {
    json!({
        "kind": kind,
        "item_id": item_id,
        "targets": targets
            .iter()
            .map(|(h, w)| json!({"host_pubkey": h.pubkey(), "wire_b64": b64::encode(w)}))
            .collect::<Vec<_>>(),
    })
}

/// One envelope item for a single target.
pub fn env_item(item_id: &str, to: &Host, wire: &str) -> Value {
    item("envelope", item_id, &[(to, wire.as_bytes())])
}

/// The lowercase hex SHA-256 of wire bytes.
pub fn wire_hash(wire: &[u8]) -> String {
    agentmbx_protocol::hash::sha256_hex(wire)
}

/// The hop header names.
pub const HOP_HEADERS: [&str; 4] = [header::HOST, header::KEY, header::TS, header::SIG];

/// A deterministic xorshift64* generator (no new dependency).
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// Seeded generator (a zero seed is replaced).
    pub fn new(seed: u64) -> XorShift {
        XorShift(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// True with probability 1/n.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    /// One element of a slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// A raw HTTP/1.1 exchange over a std `TcpStream` (for what a well-behaved client never sends):
/// writes `head` and then each body chunk (ignoring write errors once the server stopped
/// reading), then reads one response. Returns `(status, body text, seconds waited after the last
/// write)`.
pub fn raw_exchange(addr: &str, head: &str, chunks: &[Vec<u8>]) -> (u16, String, f64) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .expect("read timeout");
    s.write_all(head.as_bytes()).expect("write head");
    for c in chunks {
        if s.write_all(c).is_err() {
            break;
        }
    }
    let sent = std::time::Instant::now();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 65536];
    loop {
        if let Some(end) = find(&buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                let status = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(0);
                let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
                return (status, body, sent.elapsed().as_secs_f64());
            }
        }
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return (0, String::from_utf8_lossy(&buf).into_owned(), 0.0),
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
}

/// A raw HTTP/1.1 client connection that stays open between requests (blocking std
/// `TcpStream`: use it from `spawn_blocking`), for keep-alive and timeout tests.
#[derive(Debug)]
pub struct RawConn {
    stream: std::net::TcpStream,
    buf: Vec<u8>,
}

/// How [`RawConn::wait_closed`] ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Closed {
    /// The server closed the connection (EOF or reset) after this many seconds, having sent
    /// these bytes meanwhile.
    After(f64, String),
    /// Still open when the wait ended.
    StillOpen,
}

impl RawConn {
    /// Connects to `127.0.0.1:<port>`.
    pub fn connect(addr: &str) -> RawConn {
        let stream = std::net::TcpStream::connect(addr).expect("connect");
        RawConn {
            stream,
            buf: Vec::new(),
        }
    }

    /// Writes `bytes`.
    pub fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.stream.write_all(bytes)
    }

    /// A second handle on the same socket (to write from another thread).
    pub fn writer(&self) -> std::net::TcpStream {
        self.stream.try_clone().expect("clone the socket")
    }

    /// Reads one whole response (up to `within`): `Some((status, lower-cased head, body))`, or
    /// `None` when none came in time. Panics when the server closes the connection first.
    pub fn try_response(&mut self, within: std::time::Duration) -> Option<(u16, String, String)> {
        use std::io::Read;
        let until = std::time::Instant::now() + within;
        let mut tmp = [0u8; 65536];
        loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if self.buf.len() >= end + 4 + len {
                    let status = head
                        .split_whitespace()
                        .nth(1)
                        .and_then(|c| c.parse().ok())
                        .unwrap_or(0);
                    let body =
                        String::from_utf8_lossy(&self.buf[end + 4..end + 4 + len]).into_owned();
                    self.buf.drain(..end + 4 + len);
                    return Some((status, head, body));
                }
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            self.stream
                .set_read_timeout(Some(left))
                .expect("read timeout");
            match self.stream.read(&mut tmp) {
                Ok(0) => panic!(
                    "the server closed the connection; got {:?}",
                    String::from_utf8_lossy(&self.buf)
                ),
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return None
                }
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    /// Reads one whole response (waiting up to 20 s): `(status, lower-cased head, body)`.
    #[track_caller]
    pub fn response(&mut self) -> (u16, String, String) {
        self.try_response(std::time::Duration::from_secs(20))
            .expect("no response within 20 s")
    }

    /// Sends a `GET` of `target` and reads its response.
    #[track_caller]
    pub fn get(&mut self, target: &str) -> (u16, String, String) {
        self.send(format!("GET {target} HTTP/1.1\r\nhost: relay\r\n\r\n").as_bytes())
            .expect("send");
        self.response()
    }

    /// Waits up to `limit` for the server to close the connection; the seconds count from the
    /// call.
    pub fn wait_closed(&mut self, limit: std::time::Duration) -> Closed {
        use std::io::Read;
        let start = std::time::Instant::now();
        let mut tmp = [0u8; 65536];
        loop {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Closed::StillOpen;
            }
            self.stream
                .set_read_timeout(Some(left))
                .expect("read timeout");
            match self.stream.read(&mut tmp) {
                Ok(0) => {
                    return Closed::After(
                        start.elapsed().as_secs_f64(),
                        String::from_utf8_lossy(&self.buf).into_owned(),
                    )
                }
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => {
                    return Closed::After(
                        start.elapsed().as_secs_f64(),
                        String::from_utf8_lossy(&self.buf).into_owned(),
                    )
                }
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A store that delegates to the real one and reports a failure once [`FailingStore::fail`] was
/// called: writes then fail as the SQLite store's do after a failed COMMIT.
#[derive(Debug)]
pub struct FailingStore {
    inner: Arc<dyn RelayStore>,
    failure: std::sync::Mutex<Option<String>>,
    on_read: std::sync::Mutex<Option<(String, u32, ReadHook)>>,
    epoch_reads_fail: std::sync::atomic::AtomicBool,
}

/// What [`FailingStore::on_enrolment_read`] does at the chosen read.
#[derive(Debug, Clone, Copy)]
pub enum ReadHook {
    /// Revoke the key (committed) at this time, then read: a revocation that lands just
    /// before the read.
    Revoke(i64),
    /// Fail the read.
    Fail,
}

impl FailingStore {
    /// At the `nth` read (1-based, from now) of `key`'s enrolment, do `hook` once.
    pub fn on_enrolment_read(&self, key: &str, nth: u32, hook: ReadHook) {
        *self.on_read.lock().expect("lock") = Some((key.to_owned(), nth, hook));
    }

    /// From now on reading the epoch alone (`epoch()`) fails; rotations and pulls still work.
    pub fn fail_epoch_reads(&self) {
        self.epoch_reads_fail
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// From now on the store reports `reason` and refuses writes.
    pub fn fail(&self, reason: &str) {
        *self.failure.lock().expect("lock") = Some(reason.to_owned());
    }

    fn write(&self) -> Result<(), store::StoreError> {
        match self.failed() {
            Some(reason) => Err(store::StoreError::WriterFailed { reason }),
            None => Ok(()),
        }
    }
}

impl store::ItemStore for FailingStore {
    fn push(&self, batch: store::PushBatch) -> Result<store::PushOutcome, store::StoreError> {
        self.write()?;
        self.inner.push(batch)
    }
    fn push_then(&self, batch: store::PushBatch, done: store::PushReply) {
        match self.write() {
            Err(e) => done(Err(e)),
            Ok(()) => self.inner.push_then(batch, done),
        }
    }
    fn dedup_targets(
        &self,
        sender_pubkey: &str,
        item_id: &str,
    ) -> Result<Vec<String>, store::StoreError> {
        self.inner.dedup_targets(sender_pubkey, item_id)
    }
    fn pull(&self, req: store::PullRequest) -> Result<store::PullPage, store::StoreError> {
        self.inner.pull(req)
    }
    fn ack(&self, req: store::AckRequest) -> Result<store::AckResult, store::StoreError> {
        self.write()?;
        self.inner.ack(req)
    }
    fn info_for(&self, host_pubkey: &str) -> Result<store::HostQueueInfo, store::StoreError> {
        self.inner.info_for(host_pubkey)
    }
}

impl store::DirectoryStore for FailingStore {
    fn enrol(&self, req: store::EnrolRequest) -> Result<store::EnrolOutcome, store::StoreError> {
        self.write()?;
        self.inner.enrol(req)
    }
    fn enrolment(&self, host_pubkey: &str) -> Result<Option<store::Enrolment>, store::StoreError> {
        let fire = {
            let mut hook = self.on_read.lock().expect("lock");
            match hook.as_mut() {
                Some((key, left, what)) if key == host_pubkey => {
                    *left -= 1;
                    let what = *what;
                    if *left == 0 {
                        *hook = None;
                        Some(what)
                    } else {
                        None
                    }
                }
                _ => None,
            }
        };
        match fire {
            Some(ReadHook::Revoke(now_ms)) => {
                self.inner.revoke(host_pubkey, now_ms)?;
            }
            Some(ReadHook::Fail) => {
                return Err(store::StoreError::WriterFailed {
                    reason: "read failed".to_owned(),
                })
            }
            None => {}
        }
        self.inner.enrolment(host_pubkey)
    }
    fn live_enrolments_by_name(
        &self,
        host_name: &str,
    ) -> Result<Vec<store::Enrolment>, store::StoreError> {
        self.inner.live_enrolments_by_name(host_name)
    }
    fn live_enrolment_count(&self) -> Result<u64, store::StoreError> {
        self.inner.live_enrolment_count()
    }
    fn revoke(
        &self,
        host_pubkey: &str,
        now_ms: i64,
    ) -> Result<store::RevokeOutcome, store::StoreError> {
        self.write()?;
        self.inner.revoke(host_pubkey, now_ms)
    }
    fn put_enc_ad_v1(&self, ad: store::EncAdV1) -> Result<(), store::StoreError> {
        self.write()?;
        self.inner.put_enc_ad_v1(ad)
    }
    fn put_enc_ad_v2(&self, ad: store::EncAdV2) -> Result<(), store::StoreError> {
        self.write()?;
        self.inner.put_enc_ad_v2(ad)
    }
    fn get_enc_ad(&self, host_pubkey: &str) -> Result<Option<store::EncAd>, store::StoreError> {
        self.inner.get_enc_ad(host_pubkey)
    }
    fn put_sender_list(
        &self,
        list: store::SenderList,
    ) -> Result<store::SenderListOutcome, store::StoreError> {
        self.write()?;
        self.inner.put_sender_list(list)
    }
    fn sender_list(
        &self,
        target_pubkey: &str,
    ) -> Result<Option<store::SenderList>, store::StoreError> {
        self.inner.sender_list(target_pubkey)
    }
    fn rotate(&self, req: store::RotateRequest) -> Result<store::RotateOutcome, store::StoreError> {
        self.write()?;
        self.inner.rotate(req)
    }
    fn enrol_bound(
        &self,
        req: store::EnrolRequest,
        binding: Option<store::AccountBinding>,
    ) -> Result<store::EnrolOutcome, store::StoreError> {
        self.write()?;
        self.inner.enrol_bound(req, binding)
    }
    fn account_binding(
        &self,
        host_pubkey: &str,
    ) -> Result<Option<store::AccountBinding>, store::StoreError> {
        self.inner.account_binding(host_pubkey)
    }
    fn deny(&self, entry: store::DenyEntry) -> Result<store::DenyOutcome, store::StoreError> {
        self.write()?;
        self.inner.deny(entry)
    }
    fn undeny(&self, kind: store::DenyKind, value: &str) -> Result<bool, store::StoreError> {
        self.write()?;
        self.inner.undeny(kind, value)
    }
    fn deny_entries(&self) -> Result<Vec<store::DenyEntry>, store::StoreError> {
        self.inner.deny_entries()
    }
    fn revoke_logged(
        &self,
        host_pubkey: &str,
        now_ms: i64,
        log: store::OpEntry,
    ) -> Result<store::RevokeOutcome, store::StoreError> {
        self.write()?;
        self.inner.revoke_logged(host_pubkey, now_ms, log)
    }
    fn deny_logged(
        &self,
        entry: store::DenyEntry,
        log: store::OpEntry,
    ) -> Result<store::DenyOutcome, store::StoreError> {
        self.write()?;
        self.inner.deny_logged(entry, log)
    }
    fn undeny_logged(
        &self,
        kind: store::DenyKind,
        value: &str,
        log: store::OpEntry,
    ) -> Result<bool, store::StoreError> {
        self.write()?;
        self.inner.undeny_logged(kind, value, log)
    }
    fn denied(
        &self,
        host_fp: &str,
        client_id: Option<&str>,
        now_ms: i64,
    ) -> Result<Option<store::DenyEntry>, store::StoreError> {
        self.inner.denied(host_fp, client_id, now_ms)
    }
    fn enrolments_by_fingerprint(
        &self,
        fp: &str,
    ) -> Result<Vec<store::Enrolment>, store::StoreError> {
        self.inner.enrolments_by_fingerprint(fp)
    }
}

impl store::OperationsStore for FailingStore {
    fn epoch(&self) -> Result<String, store::StoreError> {
        if self
            .epoch_reads_fail
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(store::StoreError::WriterFailed {
                reason: "epoch read failed".to_owned(),
            });
        }
        self.inner.epoch()
    }
    fn relay_pubkey(&self) -> Result<String, store::StoreError> {
        self.inner.relay_pubkey()
    }
    fn rotate_epoch(&self) -> Result<store::EpochRotation, store::StoreError> {
        self.write()?;
        self.inner.rotate_epoch()
    }
    fn rotate_epoch_logged(
        &self,
        log: store::OpEntry,
    ) -> Result<(store::EpochRotation, serde_json::Value), store::StoreError> {
        self.write()?;
        self.inner.rotate_epoch_logged(log)
    }
    fn meta(&self, key: &str) -> Result<Option<String>, store::StoreError> {
        self.inner.meta(key)
    }
    fn set_meta(&self, key: &str, value: &str) -> Result<(), store::StoreError> {
        self.write()?;
        self.inner.set_meta(key, value)
    }
    fn append_op(&self, at_ms: i64, op: &str, receipt: &Value) -> Result<i64, store::StoreError> {
        self.write()?;
        self.inner.append_op(at_ms, op, receipt)
    }
    fn ops(&self, limit: i64) -> Result<Vec<store::OpRecord>, store::StoreError> {
        self.inner.ops(limit)
    }
    fn sweep(
        &self,
        now_ms: i64,
        signer: Arc<dyn store::NoticeSigner>,
    ) -> Result<store::SweepReport, store::StoreError> {
        self.write()?;
        self.inner.sweep(now_ms, signer)
    }
}

impl store::StoreHealth for FailingStore {
    fn heartbeat(&self) -> Result<Option<i64>, store::StoreError> {
        self.inner.heartbeat()
    }
    fn set_heartbeat(&self, now_ms: i64) -> Result<(), store::StoreError> {
        self.write()?;
        self.inner.set_heartbeat(now_ms)
    }
    /// A read of the wrapped store (its epoch): this wrapper has no writer of its own to probe.
    fn writer_answers(&self) -> Result<(), store::StoreError> {
        self.inner.epoch().map(|_| ())
    }
    fn failed(&self) -> Option<String> {
        self.failure.lock().expect("lock").clone()
    }
}

// ---- Enrolment authorities (tests/authority.rs) ------------------------------------------------
// A relay on a store directory the test keeps (so it can be stopped and started again on the
// same store, with another configuration), and hops that carry extra headers (account tokens).

impl Relay {
    /// A relay with `key` and `config` over the store in `store_dir` (created when missing),
    /// starting its clock at `now_ms`. The caller keeps the directory alive.
    pub async fn start_at(
        store_dir: &std::path::Path,
        key: HostKey,
        config: RelayConfig,
        now_ms: i64,
    ) -> Relay {
        let clock = Arc::new(ManualClock::new(now_ms));
        // A restart on the same store: the stopped relay's last background task may still
        // hold the store (and its lock) for a moment after `stop` returned.
        let relay = TestRelay::builder()
            .clock(clock.clone())
            .config(config)
            .key(key)
            .store_dir(store_dir)
            .lock_wait_ms(5_000);
        Relay::serve(relay, clock).await
    }

    /// A v2 hop signed by `host` at the relay's time, with `extra` headers (e.g.
    /// `authorization`).
    pub async fn hop_with(
        &self,
        host: &Host,
        method: &str,
        target: &str,
        body: &str,
        extra: &[(String, String)],
    ) -> Resp {
        let mut headers = host.hop_headers(method, target, body, self.now());
        headers.extend(extra.iter().cloned());
        self.send(method, target, &headers, body.as_bytes().to_vec())
            .await
    }

    /// Challenge, then enrol with `proof` in the body (`None`: no `proof` field).
    pub async fn enrol_with_proof(&self, host: &Host, proof: Option<Value>) -> Resp {
        self.enrol_with_challenge_proof(host, |_| proof).await
    }

    /// Challenge, then enrol with the `proof` built from that challenge (`None`: no `proof`
    /// field), e.g. an account proof whose cloud-key signature covers the challenge.
    pub async fn enrol_with_challenge_proof(
        &self,
        host: &Host,
        proof: impl FnOnce(&str) -> Option<Value>,
    ) -> Resp {
        let challenge = self.challenge(host).await;
        let mut body: Value =
            serde_json::from_str(&host.enrol_body(&challenge)).expect("enrol body");
        if let Some(p) = proof(&challenge) {
            body["proof"] = p;
        }
        self.plain("POST", "/v1/relay/enrol", &body.to_string())
            .await
    }
}
