//! The daemon's side of the relay push stream (`GET /v2/relay/stream`, `docs/relay-stream.md`;
//! frames and close codes: [`agentmbx_protocol::stream`]; AgentPeer relay v1, seed 004).
//!
//! - [`RelayClient::open_stream`]: the signed `GET` with the single-use nonce of the pass's
//!   signed info (`you.stream_nonce`) in its signed path, sent by the same HTTP client as every
//!   other relay call (so the proxy environment applies), upgraded to a WebSocket (RFC 6455,
//!   HTTP/1.1 `101 Switching Protocols`) with small buffers.
//! - [`serve`]: one task owns the stream and the relay passes that run while it is up, so a
//!   frame and a pull never race on received-through. It sends `resume {epoch, after}`, stores
//!   each `deliver` frame that fits ([`fit`]: `prev_seq <= received_through < seq`) through the
//!   same receive path as a pulled item (`RelayClient::receive_item` of `pull`: one transaction per
//!   item with the checkpoint and the quarantine in it), ignores one at or below the
//!   checkpoint, and pulls instead of storing one above a gap. It acks (`POST /v2/relay/ack`)
//!   after the commits of a run of frames, once no further frame is waiting. `resume_complete`
//!   with a head above what was stored, `lagged` and a gap run a pull; `epoch` runs spec §5's
//!   new-epoch handling ([`RelayClient::epoch_changed`]) and a pass, then resumes; `ping` is
//!   answered `pong` at once by a reader task (so a long pass never leaves a ping unanswered).
//!   A send or a row the LAN handed over (the loop's wake), a due row or a commit by another
//!   process (seen every [`STORE_CHECK_EVERY`] from SQLite's `data_version`: a pairing by the
//!   CLI must reach the allowlist) runs a pass without a pull, and a pull runs at least every
//!   [`SAFETY_PULL_EVERY`]. A stream silent for [`SILENCE_LIMIT`] (no ping) is taken for
//!   dead and reopened.
//! - [`StreamRecord`]: what the stream does, kept in `mailbox.db` (kv `relay-stream:<url>`,
//!   written only when it changes) for `doctor`'s `relay-stream` check.
//!
//! A pushed item is a faster pull, never a second source of truth (spec §4): this module never
//! moves received-through past a seq whose item it has not stored, never acks before the commit,
//! and never logs the nonce, the account token or wire bytes.

use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use agentmbx_protocol::stream::{
    close, ClientFrame, ServerFrame, NONCE_PARAM, PONG_TIMEOUT_MS, STREAM_PATH,
};
use agentmbx_protocol::wire::{Limits, PullItem};

use super::pull::PullPass;
use super::session::Session;
use super::{answer, push::urlencode, status_error, RelayClient, RelayError};
use crate::mailbox::outbox::Repush;
use crate::mailbox::relay_state::{kv_get, kv_set};

/// While the stream is up, a pull still runs at least this often (ms: 5 min), as a safety net.
pub const SAFETY_PULL_EVERY: Duration = Duration::from_secs(300);

/// While the stream is up, how often the daemon looks (locally, no request) whether another
/// process changed `mailbox.db` (SQLite's `data_version`: e.g. `agentmbx peers add`, which the
/// allowlist, a quarantine retry or a rotation at the relay must follow; those commands do not
/// talk to the running daemon): 30 s. A change runs a pass without a pull, as polling would
/// have. Rows the LAN hands over to the relay wake the loop directly (the LAN loop's
/// `relay_wake`), as does a send.
pub const STORE_CHECK_EVERY: Duration = Duration::from_secs(30);

/// A stream from which nothing arrived for this long is taken for dead and reopened: the relay
/// pings every 25 s ([`agentmbx_protocol::stream::PING_EVERY_MS`]), so 60 s of silence
/// ([`agentmbx_protocol::stream::PONG_TIMEOUT_MS`], the relay's own bound) means a connection
/// lost without a close (a NAT that forgot it, a network change).
pub const SILENCE_LIMIT: Duration = Duration::from_millis(PONG_TIMEOUT_MS);

/// Where the stream cannot be opened (no nonce, upgrade refused, 404), the daemon polls and
/// tries the stream again after this (5 min).
pub const RETRY_STREAM_WHEN_POLLING: Duration = Duration::from_secs(300);

/// First reconnect delay after a stream ended (1 s), doubling per failed reopen up to
/// [`RECONNECT_MAX`], each with up to a quarter of jitter.
pub const RECONNECT_MIN: Duration = Duration::from_secs(1);

/// Longest reconnect delay (60 s).
pub const RECONNECT_MAX: Duration = Duration::from_secs(60);

/// A stream that stayed up this long (60 s) resets the reconnect delay to [`RECONNECT_MIN`].
pub const STABLE_AFTER: Duration = Duration::from_secs(60);

/// After a 4409 `replaced` close the stream is reopened no sooner than this (30 s), doubling
/// per replacement up to [`REPLACED_MAX`]: two daemons with one key must not flap.
pub const REPLACED_MIN: Duration = Duration::from_secs(30);

/// Longest wait after a 4409 `replaced` close (10 min).
pub const REPLACED_MAX: Duration = Duration::from_secs(600);

/// Messages the stream's reader task may hold for the task that stores them (64); past it the
/// stream is reopened (the pass before it pulls what was not stored).
pub const FORWARD_QUEUE: usize = 64;

/// A write to the stream (`resume`, `pong`, the close at shutdown) not done within this
/// (10 s) ends it: the connection takes no bytes.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// WebSocket read buffer of the stream (bytes): 8 KiB, enough for an idle stream's pings; a
/// larger frame grows it while it is read.
pub const READ_BUFFER_BYTES: usize = 8 * 1024;

/// WebSocket write buffer (bytes): 0, each client frame is written at once (they are small).
pub const WRITE_BUFFER_BYTES: usize = 0;

/// The kv key of the stream record of `url` ([`StreamRecord`]).
pub fn record_kv(url: &str) -> String {
    format!("relay-stream:{url}")
}

/// The upgraded connection of a stream.
pub type Ws = WebSocketStream<reqwest::Upgraded>;

/// Where a `deliver` frame stands against received-through (`docs/relay-stream.md` "Order and
/// gaps").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// `prev_seq <= received_through < seq`: store it and move received-through to `seq`.
    Store,
    /// `seq <= received_through`: already stored; ignore it.
    Old,
    /// `received_through < prev_seq` (an item not stored lies before it), or a frame whose
    /// `prev_seq` is not below its `seq`: store nothing from it and pull.
    Gap,
}

/// The prev_seq rule: where a `deliver {seq, prev_seq}` stands against `received_through`.
pub fn fit(received_through: i64, prev_seq: i64, seq: i64) -> Fit {
    if seq <= received_through {
        Fit::Old
    } else if prev_seq <= received_through && prev_seq < seq {
        Fit::Store
    } else {
        Fit::Gap
    }
}

/// What the stream to one relay does, as `doctor` reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StreamState {
    /// The stream is open: mail arrives as it is pushed; the periodic pull is stopped.
    Up,
    /// The stream ended and is reopened after a backoff; the daemon polls meanwhile.
    Reconnecting,
    /// The relay does not offer the stream, or the upgrade was refused: the daemon polls at
    /// `relay_pull_interval_ms` and tries the stream again every 5 min.
    Polling,
    /// `relay_stream = false` or `MBX_RELAY_STREAM=0`: the daemon polls.
    Disabled,
}

/// The stream record of one relay (kv `relay-stream:<url>`, JSON), written by the relay loop
/// when its state or reason changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamRecord {
    /// The state.
    pub state: StreamState,
    /// Since when (ms since the Unix epoch).
    pub since_ms: i64,
    /// Why it polls or reconnects, for a person (never a secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// 4409 `replaced` closes since the daemon started.
    #[serde(default)]
    pub replaced: u64,
}

/// Reads the stream record of `url`. Errors: storage failures; an unreadable record is `None`.
pub fn read_record(
    c: &rusqlite::Connection,
    url: &str,
) -> Result<Option<StreamRecord>, crate::mailbox::MailboxError> {
    Ok(kv_get(c, &record_kv(url))?.and_then(|t| serde_json::from_str(&t).ok()))
}

/// Why the stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The relay does not offer the stream here (404, or an answer other than `101` to the
    /// upgrade: an older relay, or a proxy that refuses upgrades): poll.
    #[error("{0}")]
    NotOffered(String),
    /// Any other failure (network, a 401 `BAD_NONCE`, a 429, …): retry with backoff.
    #[error(transparent)]
    Relay(#[from] RelayError),
}

/// Whether `e` is the relay's 401 `BAD_NONCE` to a stream opening (the nonce expired, was
/// used, or is unknown: `docs/relay-stream.md` "Opening it").
pub fn bad_nonce(e: &RelayError) -> bool {
    matches!(e, RelayError::Status { status: 401, body: Some(b), .. } if b.code == "BAD_NONCE")
}

/// Why an answer other than `101` (`status`, body `bytes`) to the stream's upgrade means the
/// stream is not offered here, so the daemon polls and tries again in
/// [`RETRY_STREAM_WHEN_POLLING`]: a 404 (an older relay), a 400 `NOT_UPGRADE` or any other
/// answer to the upgrade (2xx, 3xx, 426, 501: the upgrade headers did not reach the relay, a
/// proxy that does not pass them). `None`: an error to retry with backoff.
pub fn not_offered(status: u16, bytes: &[u8]) -> Option<String> {
    let code = serde_json::from_slice::<agentmbx_protocol::wire::ErrorBody>(bytes)
        .ok()
        .map(|b| b.code);
    match status {
        404 => Some("the relay does not offer the push stream (404)".to_string()),
        s if s < 400 || matches!(s, 426 | 501) || code.as_deref() == Some("NOT_UPGRADE") => {
            Some(format!(
                "the upgrade to the push stream was refused (HTTP {s}; a proxy that does not pass WebSocket upgrades?)"
            ))
        }
        _ => None,
    }
}

impl RelayClient {
    /// Opens the push stream with `nonce` (`you.stream_nonce` of this pass's signed info): the
    /// signed `GET /v2/relay/stream?nonce=<nonce>` (the hop as every relay call signs it) with the
    /// RFC 6455 upgrade headers; the `101` answer's `Sec-WebSocket-Accept` is checked, then the
    /// connection is a WebSocket client with [`READ_BUFFER_BYTES`] and [`WRITE_BUFFER_BYTES`],
    /// reading messages up to the pull answer cap of `limits` (one item as a pull page carries
    /// it). Errors: [`OpenError::NotOffered`] for a 404 or another answer to the upgrade
    /// (2xx, 3xx, 426, 501), [`OpenError::Relay`] otherwise ([`RelayError::RateLimited`] for a
    /// 429, [`RelayError::Status`] with the relay's code, e.g. 401 `BAD_NONCE`).
    pub async fn open_stream(&self, nonce: &str, limits: &Limits) -> Result<Ws, OpenError> {
        crate::liveness::progress();
        let target = format!("{STREAM_PATH}?{NONCE_PARAM}={}", urlencode(nonce));
        let key = generate_key();
        let resp = self
            .signed_request("GET", &target, "")
            .await?
            .header(reqwest::header::CONNECTION, "Upgrade")
            .header(reqwest::header::UPGRADE, "websocket")
            .header(reqwest::header::SEC_WEBSOCKET_VERSION, "13")
            .header(reqwest::header::SEC_WEBSOCKET_KEY, &key)
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
        let status = resp.status().as_u16();
        self.observed.note_date(
            resp.headers()
                .get(reqwest::header::DATE)
                .and_then(|v| v.to_str().ok()),
        );
        if status != 101 {
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let bytes = answer::read_capped(resp, answer::MAX_ANSWER).await?;
            if let Some(why) = not_offered(status, &bytes) {
                return Err(OpenError::NotOffered(why));
            }
            return Err(match status {
                429 => OpenError::Relay(super::rate_limited(retry_after.as_deref(), &bytes)),
                _ => {
                    if let Some(account) = self.account.as_ref().filter(|_| status == 401) {
                        if super::account::refused_token(&bytes) {
                            account.invalidate().await;
                        }
                    }
                    OpenError::Relay(status_error(status, &bytes))
                }
            });
        }
        let accept = resp
            .headers()
            .get(reqwest::header::SEC_WEBSOCKET_ACCEPT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if accept.as_deref() != Some(derive_accept_key(key.as_bytes()).as_str()) {
            return Err(OpenError::NotOffered(
                "the upgrade answer is not the relay's (wrong Sec-WebSocket-Accept): a proxy in the way?"
                    .to_string(),
            ));
        }
        let upgraded = resp
            .upgrade()
            .await
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
        let max = answer::pull_answer_cap(limits);
        let config = WebSocketConfig::default()
            .read_buffer_size(READ_BUFFER_BYTES)
            .write_buffer_size(WRITE_BUFFER_BYTES)
            .max_message_size(Some(max))
            .max_frame_size(Some(max));
        Ok(WebSocketStream::from_raw_socket(upgraded, Role::Client, Some(config)).await)
    }

    /// Writes the stream record when its state or reason changed (or the replaced count);
    /// errors are logged, never fatal (the record is for `doctor`).
    pub(super) async fn note_stream(
        &self,
        state: StreamState,
        reason: Option<String>,
        replaced: u64,
    ) {
        let (url, now) = (self.url.clone(), self.clock.now_ms());
        let done = self
            .mailbox
            .run(move |c| {
                let old = read_record(c, &url)?;
                if old.as_ref().is_some_and(|o| {
                    o.state == state && o.reason == reason && o.replaced == replaced
                }) {
                    return Ok(());
                }
                let rec = StreamRecord {
                    state,
                    since_ms: old.filter(|o| o.state == state).map_or(now, |o| o.since_ms),
                    reason,
                    replaced,
                };
                let text = serde_json::to_string(&rec).unwrap_or_default();
                kv_set(c, &record_kv(&url), &text)
            })
            .await;
        if let Err(e) = done {
            tracing::debug!(relay = %self.url, error = %e, "stream record not written");
        }
    }
}

/// How a stream ended.
#[derive(Debug)]
pub enum End {
    /// The daemon is stopping (the stream was closed with 1000).
    Shutdown,
    /// The relay closed the stream with `code` (`None`: no code, or the connection broke).
    Closed {
        /// The close code (`agentmbx_protocol::stream::close`).
        code: Option<u16>,
        /// What happened, for the log.
        reason: String,
    },
    /// A pass, a receive or an ack failed: the relay loop handles it as a pass's error.
    Failed(RelayError),
}

/// What the frames of one turn of [`serve`] asked for.
#[derive(Debug, Default)]
pub(super) struct Turn {
    /// Items stored since the last ack.
    pub(super) ack: bool,
    /// A pull is needed (a gap, `lagged`, a replay that stopped below the head, an epoch, the
    /// safety net).
    pub(super) pull: bool,
    /// A push pass is needed (a send, a due row).
    pub(super) push: bool,
    /// The relay must be told where to resume (after an epoch change).
    pub(super) resume: bool,
}

/// The stream's view of where it stands: the epoch of its last `resume` and received-through.
#[derive(Debug)]
pub(super) struct Position {
    pub(super) epoch: String,
    pub(super) through: i64,
    /// The `after` of the `resume` whose replay is running (sent, its `resume_complete` not
    /// yet read; `None`: no replay runs). The relay answers a second `resume` during a replay
    /// with `bad_frame`, so none is sent until then.
    pub(super) resumed: Option<i64>,
}

/// The writing half of an open stream, shared by [`serve`] and its reader task (which
/// answers pings).
type Sink = std::sync::Arc<tokio::sync::Mutex<SplitSink<Ws, Message>>>;

/// What the reader task of [`serve`] hands to it.
enum Incoming {
    /// A message other than a ping (pings are answered by the reader).
    Msg(Message),
    /// The stream ended: closed or broken, silent for [`SILENCE_LIMIT`], a pong not written
    /// within [`SEND_TIMEOUT`], or more than [`FORWARD_QUEUE`] messages waiting.
    End(End),
}

/// Aborts the reader task when [`serve`] returns, whichever way.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves an open stream until it ends: sends `resume`, then handles frames, sends (`wake`),
/// due rows, the store check, the safety-net pull and `shutdown` (module docs). A reader task
/// reads the connection all the time, answers each `ping` at once and forwards the other
/// messages (at most [`FORWARD_QUEUE`] waiting), so a long pass neither leaves a ping
/// unanswered nor stops the reading; this task handles the forwarded frames and the passes one
/// at a time, so they never race on received-through. Before each pass the relay key pin is
/// read again (`relay set --key` applies while the stream lives). `session` is the pass that
/// preceded the opening (it pulled). Returns how it ended; the caller reconnects.
pub async fn serve(
    client: &mut RelayClient,
    ws: Ws,
    session: &Session,
    wake: &tokio::sync::Notify,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) -> End {
    let (write, read) = ws.split();
    let sink: Sink = std::sync::Arc::new(tokio::sync::Mutex::new(write));
    let (tx, mut rx) = tokio::sync::mpsc::channel(FORWARD_QUEUE);
    let _reader = AbortOnDrop(tokio::spawn(read_loop(read, sink.clone(), tx)));
    let mut pos = match start(client, session).await {
        Ok(p) => p,
        Err(e) => return End::Failed(e),
    };
    if let Err(end) = send(&sink, &resume(&pos)).await {
        return end;
    }
    pos.resumed = Some(pos.through);
    // A `resume` asked for while a replay ran: sent once its `resume_complete` arrived.
    let mut resume_owed = false;
    // The pass that preceded the stream pulled.
    let mut last_pull = tokio::time::Instant::now();
    let mut due_row = next_due(client).await;
    let mut version = data_version(client).await;
    let mut next_check = tokio::time::Instant::now() + STORE_CHECK_EVERY;
    loop {
        let safety = last_pull + SAFETY_PULL_EVERY;
        let due = due_row.map_or(safety, |d| d.min(safety));
        let mut turn = Turn::default();
        let event = crate::liveness::waiting(async {
            tokio::select! {
                biased;
                _ = shutdown.changed() => Event::Stop,
                m = rx.recv() => Event::Incoming(m),
                _ = wake.notified() => Event::Wake,
                _ = tokio::time::sleep_until(due) => Event::Due,
                _ = tokio::time::sleep_until(next_check) => Event::Check,
            }
        })
        .await;
        crate::liveness::progress();
        match event {
            Event::Stop => {
                let close = Message::Close(Some(CloseFrame {
                    code: CloseCode::Normal,
                    reason: "daemon stopping".into(),
                }));
                let _ = tokio::time::timeout(SEND_TIMEOUT, async {
                    sink.lock().await.send(close).await
                })
                .await;
                return End::Shutdown;
            }
            Event::Incoming(m) => {
                if let Err(end) = incoming(client, &sink, m, &mut pos, &mut turn).await {
                    return end;
                }
                // The run of frames already waiting, before one ack for all of them.
                while let Ok(m) = rx.try_recv() {
                    if let Err(end) = incoming(client, &sink, Some(m), &mut pos, &mut turn).await {
                        return end;
                    }
                }
            }
            // A send: always a pass (the daemon's own commit does not move data_version).
            Event::Wake => turn.push = true,
            // A due row, or the safety net.
            Event::Due => {
                turn.pull = tokio::time::Instant::now() >= safety;
                turn.push = true;
            }
            Event::Check => {
                // Another process's commit (a pairing by the CLI, a pin): a pass.
                next_check = tokio::time::Instant::now() + STORE_CHECK_EVERY;
                let v = data_version(client).await;
                turn.push = v.is_some() && v != version;
                if v.is_some() {
                    version = v;
                }
            }
        }
        if turn.ack {
            match client.ack(&pos.epoch, pos.through).await {
                Ok(true) => {}
                // An epoch change or a rewind the ack revealed, now recorded: pull and resume.
                Ok(false) => {
                    turn.pull = true;
                    turn.resume = true;
                }
                Err(e) => return End::Failed(e),
            }
        }
        if turn.pull || turn.push {
            if let Err(e) = client.reload_pin().await {
                return End::Failed(e);
            }
            match super::pass_session(client, turn.pull).await {
                Ok(s) => {
                    if turn.pull {
                        last_pull = tokio::time::Instant::now();
                    }
                    let epoch = match client.current_epoch(&s.epoch).await {
                        Ok(e) => e,
                        Err(e) => return End::Failed(e),
                    };
                    if epoch != pos.epoch {
                        turn.resume = true;
                    }
                    let resumed = pos.resumed;
                    pos = match at(client, &epoch).await {
                        Ok(p) => Position { resumed, ..p },
                        Err(e) => return End::Failed(e),
                    };
                }
                Err(e) => return End::Failed(e),
            }
            due_row = next_due(client).await;
        }
        resume_owed |= turn.resume;
        if resume_owed && pos.resumed.is_none() {
            if let Err(end) = send(&sink, &resume(&pos)).await {
                return end;
            }
            pos.resumed = Some(pos.through);
            resume_owed = false;
        }
    }
}

/// What woke [`serve`].
enum Event {
    /// The daemon stops.
    Stop,
    /// What the reader task forwarded (`None`: it is gone).
    Incoming(Option<Incoming>),
    /// A send (the relay loop's wake).
    Wake,
    /// A row due for the relay, or the safety-net pull.
    Due,
    /// The store check ([`STORE_CHECK_EVERY`]).
    Check,
}

/// The reader task of [`serve`]: reads the connection, answers each `ping` with its `pong`
/// at once, and forwards every other message to `tx`. Ends after forwarding a close, or with
/// [`Incoming::End`] when the connection ends or breaks, nothing arrived for
/// [`SILENCE_LIMIT`], a pong could not be written, or `tx` is full ([`FORWARD_QUEUE`]: the
/// stream is reopened and the pass before it pulls what was not stored).
async fn read_loop(mut read: SplitStream<Ws>, sink: Sink, tx: tokio::sync::mpsc::Sender<Incoming>) {
    let closed = |reason: String| End::Closed { code: None, reason };
    loop {
        let msg = match tokio::time::timeout(SILENCE_LIMIT, read.next()).await {
            Err(_) => {
                let why = format!("nothing from the relay for {} s", SILENCE_LIMIT.as_secs());
                let _ = tx.send(Incoming::End(closed(why))).await;
                return;
            }
            Ok(None) => {
                let _ = tx
                    .send(Incoming::End(closed("the connection ended".into())))
                    .await;
                return;
            }
            Ok(Some(Err(e))) => {
                let why = format!("stream broken: {e}");
                let _ = tx.send(Incoming::End(closed(why))).await;
                return;
            }
            Ok(Some(Ok(m))) => m,
        };
        if let Some(id) = ping_id(&msg) {
            if let Err(end) = send(&sink, &ClientFrame::Pong { id }).await {
                let _ = tx.send(Incoming::End(end)).await;
                return;
            }
            continue;
        }
        let close = matches!(msg, Message::Close(_));
        match tx.try_send(Incoming::Msg(msg)) {
            Ok(()) => {}
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                let why = format!(
                    "more than {FORWARD_QUEUE} stream frames waited to be stored; reopening (a pull carries them)"
                );
                let _ = tx.send(Incoming::End(closed(why))).await;
                return;
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return,
        }
        if close {
            return;
        }
    }
}

/// The id of a `ping` text frame (small: the length is checked before parsing).
fn ping_id(msg: &Message) -> Option<u64> {
    match msg {
        Message::Text(t) if t.len() <= 128 => match serde_json::from_str(t.as_str()) {
            Ok(ServerFrame::Ping { id }) => Some(id),
            _ => None,
        },
        _ => None,
    }
}

/// The position to resume from after the pass that preceded the stream.
async fn start(client: &RelayClient, session: &Session) -> Result<Position, RelayError> {
    let epoch = client.current_epoch(&session.epoch).await?;
    at(client, &epoch).await
}

/// Received-through in `epoch` (an epoch change when the position is of another one).
pub(super) async fn at(client: &RelayClient, epoch: &str) -> Result<Position, RelayError> {
    Ok(Position {
        epoch: epoch.to_string(),
        through: client.position(epoch).await?,
        resumed: None,
    })
}

fn resume(pos: &Position) -> ClientFrame {
    ClientFrame::Resume {
        epoch: pos.epoch.clone(),
        after: pos.through,
    }
}

/// SQLite's `data_version` of the store's connection: it changes when another connection
/// (another process) committed; `None` when it cannot be read (the next check tries again).
async fn data_version(client: &RelayClient) -> Option<i64> {
    client
        .mailbox
        .run(|c| Ok(c.query_row("PRAGMA data_version", [], |r| r.get::<_, i64>(0))?))
        .await
        .ok()
}

fn due_at(c: &rusqlite::Connection, now: i64) -> Result<Option<i64>, crate::mailbox::MailboxError> {
    let rows = crate::mailbox::outbox::next_due_for_relay(c, now)?;
    let receipts = crate::mailbox::receipts::next_due_for_relay(c, now)?;
    Ok(rows.into_iter().chain(receipts).min())
}

fn instant_of(at_ms: i64, now_ms: i64) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_millis((at_ms - now_ms).max(0) as u64)
}

/// When the next outbox row or receipt is due for the relay.
async fn next_due(client: &RelayClient) -> Option<tokio::time::Instant> {
    let now = client.clock.now_ms();
    let at = client
        .mailbox
        .run(move |c| due_at(c, now))
        .await
        .ok()
        .flatten()?;
    Some(instant_of(at, now))
}

/// Writes `frame`, waiting at most [`SEND_TIMEOUT`] (a connection that takes no bytes is
/// broken).
async fn send(sink: &Sink, frame: &ClientFrame) -> Result<(), End> {
    let text = serde_json::to_string(frame).map_err(|e| End::Closed {
        code: None,
        reason: format!("frame not written: {e}"),
    })?;
    let sent = tokio::time::timeout(SEND_TIMEOUT, async {
        sink.lock().await.send(Message::text(text)).await
    })
    .await;
    match sent {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(End::Closed {
            code: None,
            reason: format!("stream broken: {e}"),
        }),
        Err(_) => Err(End::Closed {
            code: None,
            reason: format!("a frame not written within {} s", SEND_TIMEOUT.as_secs()),
        }),
    }
}

/// Handles what the reader task forwarded (module docs).
async fn incoming(
    client: &RelayClient,
    sink: &Sink,
    msg: Option<Incoming>,
    pos: &mut Position,
    turn: &mut Turn,
) -> Result<(), End> {
    let text = match msg {
        None => {
            return Err(End::Closed {
                code: None,
                reason: "the connection ended".to_string(),
            })
        }
        Some(Incoming::End(end)) => return Err(end),
        Some(Incoming::Msg(Message::Text(t))) => t,
        Some(Incoming::Msg(Message::Close(c))) => {
            return Err(End::Closed {
                code: c.as_ref().map(|c| u16::from(c.code)),
                reason: c.map_or_else(String::new, |c| c.reason.to_string()),
            })
        }
        // Control frames are answered by the library; a binary frame is not ours.
        Some(Incoming::Msg(_)) => return Ok(()),
    };
    let frame: ServerFrame = match serde_json::from_str(text.as_str()) {
        Ok(f) => f,
        Err(_) => {
            unreadable(client, text.as_str(), turn);
            return Ok(());
        }
    };
    if let Some(reply) = handle(client, frame, pos, turn).await? {
        send(sink, &reply).await?;
    }
    Ok(())
}

/// The server frame types whose loss can hide mail: one of them that does not parse asks for a
/// pull (and a new `resume`, as after `lagged`).
const MAIL_FRAMES: [&str; 4] = ["deliver", "lagged", "epoch", "resume_complete"];

/// A text frame that is not a [`ServerFrame`]: one of an unknown type is ignored (logged at
/// debug); one of a type in [`MAIL_FRAMES`] without its fields is logged at warn and a pull
/// and a `resume` follow, so no item it may have carried is lost.
pub(super) fn unreadable(client: &RelayClient, text: &str, turn: &mut Turn) {
    let kind = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v.get("type")?.as_str().map(str::to_owned));
    match kind {
        Some(k) if MAIL_FRAMES.contains(&k.as_str()) => {
            tracing::warn!(relay = %client.url, frame_type = %k, "a stream frame of the relay could not be read: pulling");
            turn.pull = true;
            turn.resume = true;
        }
        _ => {
            tracing::debug!(relay = %client.url, "stream frame of an unknown type or shape ignored");
        }
    }
}

/// Handles one frame of the relay at `pos` (module docs): stores a `deliver` that fits (moving
/// `pos.through` in the item's transaction), records in `turn` what must follow (an ack, a
/// pull, a push pass, a new `resume`), and returns the frame to answer with (`pong`). Errors:
/// [`End::Failed`] when the store or the epoch handling failed.
pub(super) async fn handle(
    client: &RelayClient,
    frame: ServerFrame,
    pos: &mut Position,
    turn: &mut Turn,
) -> Result<Option<ClientFrame>, End> {
    match frame {
        ServerFrame::Deliver {
            seq,
            prev_seq,
            kind,
            item_id,
            sender_pubkey,
            wire_b64,
            replay,
        } => match fit(pos.through, prev_seq, seq) {
            Fit::Old => {}
            Fit::Gap => {
                tracing::debug!(relay = %client.url, seq, prev_seq, through = pos.through, replay, "stream frame above a gap: pulling");
                turn.pull = true;
            }
            // A pull is already owed: it stores this one in order.
            Fit::Store if turn.pull => {}
            Fit::Store => {
                let item = PullItem {
                    seq,
                    kind,
                    item_id,
                    sender_pubkey,
                    wire_b64,
                };
                let mut counts = PullPass::default();
                client
                    .receive_item(&pos.epoch, item, true, &mut counts)
                    .await
                    .map_err(End::Failed)?;
                pos.through = seq;
                turn.ack = true;
            }
        },
        ServerFrame::ResumeComplete { replayed, head_seq } => {
            // Compared with the `after` of the resume answered: a pull since then may have
            // moved received-through beyond the head the relay saw.
            let after = pos.resumed.take().unwrap_or(pos.through);
            if head_seq > pos.through {
                tracing::debug!(relay = %client.url, replayed, head_seq, through = pos.through, "the replay stopped below the head: pulling");
                turn.pull = true;
            } else if head_seq < after {
                // The relay went back in time (spec §5 rewind): the same rule as a pull page's
                // head_seq below received-through.
                client
                    .epoch_changed(
                        &pos.epoch,
                        Repush::Rewind,
                        "head_seq below received_through",
                    )
                    .await
                    .map_err(End::Failed)?;
                *pos = at(client, &pos.epoch.clone()).await.map_err(End::Failed)?;
                turn.pull = true;
                turn.resume = true;
                turn.push = true;
            }
        }
        ServerFrame::Ping { id } => return Ok(Some(ClientFrame::Pong { id })),
        ServerFrame::Epoch { epoch } => {
            tracing::info!(relay = %client.url, epoch = %epoch, "the stream announced the relay's epoch");
            client
                .epoch_changed(
                    &epoch,
                    Repush::Epoch,
                    "another epoch announced on the stream",
                )
                .await
                .map_err(End::Failed)?;
            *pos = at(client, &epoch).await.map_err(End::Failed)?;
            turn.pull = true;
            turn.push = true;
            turn.resume = true;
        }
        ServerFrame::Lagged { from_seq } => {
            // No live frame follows until the next `resume`: pull, then resume.
            tracing::debug!(relay = %client.url, from_seq, "the relay dropped live frames: pulling");
            turn.pull = true;
            turn.resume = true;
        }
        ServerFrame::Error {
            reason, frame_type, ..
        } => {
            tracing::debug!(relay = %client.url, reason = %reason, frame_type = ?frame_type, "the relay could not use a frame of ours");
        }
    }
    Ok(None)
}

/// The close codes of the relay, by what the loop does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterClose {
    /// Reconnect with backoff (1001, 1008, 1009, 1013, a broken connection).
    Reconnect,
    /// The account token expired (4401): fresh token, reopen now.
    NewToken,
    /// Revoked or denied while connected (4403): the pass's refusal handling.
    Refused,
    /// Another stream for this key replaced this one (4409): count it, long backoff.
    Replaced,
}

/// What a close `code` asks of the loop (`docs/relay-stream.md` "Close codes").
pub fn after_close(code: Option<u16>) -> AfterClose {
    match code {
        Some(close::TOKEN_EXPIRED) => AfterClose::NewToken,
        Some(close::AUTH) => AfterClose::Refused,
        Some(close::REPLACED) => AfterClose::Replaced,
        _ => AfterClose::Reconnect,
    }
}

/// The reconnect delay after `failures` reopen attempts in a row (0 for the first), with up to
/// a quarter of it added as jitter: [`RECONNECT_MIN`] doubling up to [`RECONNECT_MAX`].
pub fn reconnect_delay(failures: u32) -> Duration {
    with_jitter((RECONNECT_MIN * 2u32.saturating_pow(failures.min(6))).min(RECONNECT_MAX))
}

/// The wait after the `n`-th replacement (1 for the first): [`REPLACED_MIN`] doubling up to
/// [`REPLACED_MAX`], with jitter.
pub fn replaced_delay(n: u64) -> Duration {
    let exp = u32::try_from(n.saturating_sub(1).min(5)).unwrap_or(5);
    with_jitter((REPLACED_MIN * 2u32.pow(exp)).min(REPLACED_MAX))
}

fn with_jitter(d: Duration) -> Duration {
    use rand::Rng;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let extra = rand::thread_rng().gen_range(0..=ms / 4);
    Duration::from_millis(ms.saturating_add(extra))
}

#[cfg(test)]
mod tests;
