//! One push stream's connection loop (`docs/relay-stream.md` "Frames", "Order and gaps",
//! "Bounds", "Close codes"), run on the task axum's upgrade spawned: that one task per
//! connection, no other task and no timer but the ping interval (plus a deadline only while a
//! ping is unanswered or an account token bounds the stream).
//!
//! # What it owns
//! Reading client frames (`resume`, `pong`; anything else is answered `error`, at most
//! [`BAD_FRAME_BURST`] then one per [`BAD_FRAME_EVERY`], past that 1008), the replay of one
//! pull page after a `resume` (read in chunks of [`REPLAY_CHUNK_BYTES`], each reserved from
//! the relay-wide budget until written), the ping (random ids) and its pong deadline (from the
//! oldest unanswered ping), the account token's expiry, writing the queued live frames and the
//! announced `epoch` ([`super::hub`]) and the close with its code. On every `resume` (in the
//! same blocking call as the replay's first read) and every [`RECHECK_EVERY_PINGS`] pings it
//! reads the key's enrolment and deny entries again ([`super::key_may_stream`]): a revoked or
//! denied key is closed with 4403 even when the close request never reached the stream.
//!
//! Each iteration of the loop first looks at the control side (a close request, the token
//! deadline, the ping, the pong deadline), then reads or writes at most one frame (after a
//! read, a pending write goes first; while [`MAX_CONTROL_FRAMES`] answers wait, nothing is
//! read), and only last waits for the hub's wake-up, so a sustained flow of `deliver` frames
//! never starves pings, deadlines or close requests, and a client that keeps sending never
//! starves the writes.
//! Writing uses the sink's readiness (cancel-safe): a frame is taken from the queue only once
//! the socket can take it, so a slow reader leaves frames in the bounded queue, where the
//! publish path turns the overflow into `lagged` (during a replay, [`Hub::end_replay`] decides
//! whether the replay carried it).
//!
//! # What it must never do
//! Send a live frame for a seq the replay already sent, send live frames before the replay
//! and its `resume_complete`, hold more than one replay chunk, or buffer a client frame over
//! [`MAX_CLIENT_FRAME`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use futures_util::{SinkExt, StreamExt};
use tokio::time::Instant;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::stream::{
    close, ClientFrame, ServerFrame, MAX_CLIENT_FRAME, STREAM_QUEUE_BYTES,
};

use super::hub::{frame_text, Hub, Registration, Stream};
use crate::store::{PullPage, PullRequest, PulledItem, RelayStore, MAX_PULL_ITEMS};

/// Control frames (pings, `error` answers, `epoch` answers) waiting to be written, at most:
/// while the queue is full the loop reads no client frame (a client that does not read its
/// answers is held back by TCP), and a ping due then is not queued (its deadline still runs).
pub const MAX_CONTROL_FRAMES: usize = 64;

/// Frames the relay answers `error` (unknown type, bad `resume`/`pong`) a client may send in a
/// burst before the rate applies: 8 (seed 004: continued abuse after a nack closes with 1008).
pub const BAD_FRAME_BURST: u32 = 8;

/// After the burst, one more answered bad frame per 1,000 ms; a client over that rate is closed
/// with [`close::POLICY`].
pub const BAD_FRAME_EVERY: Duration = Duration::from_millis(1_000);

/// Pings sent and not answered yet, at most (the pong timeout closes the stream long before a
/// client at the contract's timers gets there: 60 s / 25 s).
const MAX_OUTSTANDING_PINGS: usize = 8;

/// How long the close frame may take to leave before the connection is dropped anyway.
pub const CLOSE_WRITE_LIMIT: Duration = Duration::from_secs(1);

/// What the loop needs from the relay (the handler builds it from the relay's state).
#[derive(Debug, Clone)]
pub struct ConnParams {
    /// The store (pull pages for the replay).
    pub store: Arc<dyn RelayStore>,
    /// The relay clock (the account token's expiry is in its time).
    pub clock: SharedClock,
    /// `max_pull`: items in one replay (clamped to `1..=`[`MAX_PULL_ITEMS`]).
    pub max_pull: i64,
    /// `max_pull_bytes`: about the wire bytes of one replay.
    pub max_pull_bytes: u64,
    /// The account token's `exp` in ms (account relays, spec §8): the stream closes with
    /// [`close::TOKEN_EXPIRED`] once the relay clock reaches it.
    pub token_exp_ms: Option<i64>,
    /// Ping period (the contract's
    /// [`PING_EVERY_MS`](agentmbx_protocol::stream::PING_EVERY_MS), [`super::hub::Hub::timers`]).
    pub ping_every: Duration,
    /// No pong for this long after a ping closes with [`close::POLICY`]
    /// ([`PONG_TIMEOUT_MS`](agentmbx_protocol::stream::PONG_TIMEOUT_MS)).
    pub pong_timeout: Duration,
    /// The largest frame the socket takes, in bytes (its `max_write_buffer_size` less one): a
    /// replay ends with `resume_complete` before an item whose frame is larger (one stored
    /// under an earlier, larger `max_item_bytes`), so the client pulls it instead of
    /// reconnecting into it.
    pub max_frame_bytes: usize,
}

/// How a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The relay closed it with this code.
    Closed(u16),
    /// The client closed it, or the socket failed.
    Gone,
}

/// Wire bytes one replay chunk reads at most: about [`STREAM_QUEUE_BYTES`] of `deliver`
/// frames once in base64 (a single larger item is read alone).
pub const REPLAY_CHUNK_BYTES: u64 = (STREAM_QUEUE_BYTES / 4 * 3) as u64;

/// The replay in progress after a `resume`: read from the store in chunks of about
/// [`REPLAY_CHUNK_BYTES`], the next chunk only once the previous one was written, up to one
/// pull page (`max_pull` items, about `max_pull_bytes`). Each chunk's frame bytes are reserved
/// from the relay-wide budget until written.
#[derive(Debug, Default)]
struct Replay {
    /// From the `resume` until its `resume_complete` was taken for writing.
    active: bool,
    /// The epoch the replay reads in.
    epoch: String,
    /// The current chunk, not written yet.
    chunk: VecDeque<PulledItem>,
    /// Budget bytes reserved for the frames of `chunk`.
    reserved: usize,
    /// The last replayed seq (the `resume`'s `after` before the first).
    prev_seq: i64,
    /// Items and wire bytes replayed so far (the page bounds).
    sent: u64,
    sent_bytes: u64,
    /// The caller's head seq at the last chunk read.
    head_seq: i64,
    /// More stored items follow the last chunk read.
    more: bool,
    /// The replay ends after `chunk` (an item too large for a frame was met, or the relay-wide
    /// budget could not give the chunk).
    last: bool,
}

/// The bytes a replayed item's `deliver` frame takes (base64 of the wire plus the fields): what
/// a chunk reserves from the budget.
fn frame_bytes(item: &PulledItem) -> usize {
    item.wire
        .len()
        .saturating_add(2)
        .saturating_div(3)
        .saturating_mul(4)
        .saturating_add(item.item_id.len() + item.sender_pubkey.len() + item.kind.len() + 160)
}

/// What one client text frame asks for.
enum Asked {
    Resume {
        epoch: String,
        after: i64,
    },
    Pong(u64),
    /// An `error` answer (counted against [`BAD_FRAME_BURST`] / [`BAD_FRAME_EVERY`]).
    Answer(String),
    Close(u16),
}

/// The allowance of answered bad frames: a token bucket of [`BAD_FRAME_BURST`] refilled one per
/// [`BAD_FRAME_EVERY`].
#[derive(Debug)]
struct Allowance {
    tokens: u32,
    since: Instant,
}

impl Allowance {
    fn new(now: Instant) -> Self {
        Allowance {
            tokens: BAD_FRAME_BURST,
            since: now,
        }
    }

    /// Takes one answer; false when the client is over the rate.
    fn take(&mut self, now: Instant) -> bool {
        let every = BAD_FRAME_EVERY.as_millis().max(1);
        let refill = now.saturating_duration_since(self.since).as_millis() / every;
        if refill > 0 {
            let refill = u32::try_from(refill).unwrap_or(u32::MAX);
            self.tokens = self.tokens.saturating_add(refill).min(BAD_FRAME_BURST);
            self.since = if self.tokens == BAD_FRAME_BURST {
                now
            } else {
                self.since + BAD_FRAME_EVERY * refill
            };
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

/// Pings sent and not answered yet, oldest first: `(id, sent at)`.
#[derive(Debug, Default)]
struct Pings {
    outstanding: VecDeque<(u64, Instant)>,
}

impl Pings {
    /// A fresh random id (not guessable from earlier ones), remembered with `now`.
    fn send(&mut self, now: Instant) -> u64 {
        let id = rand::random::<u64>() >> 11; // stays exact as a JSON number (53 bits)
        if self.outstanding.len() >= MAX_OUTSTANDING_PINGS {
            // The oldest keeps the deadline; the newest is replaced.
            self.outstanding.pop_back();
        }
        self.outstanding.push_back((id, now));
        id
    }

    /// A pong for `id`: that ping and every older one are answered (a client answers in
    /// order). An unknown id changes nothing.
    fn answer(&mut self, id: u64) {
        if let Some(pos) = self.outstanding.iter().position(|(p, _)| *p == id) {
            self.outstanding.drain(..=pos);
        }
    }

    /// When the oldest unanswered ping times out.
    fn deadline(&self, timeout: Duration) -> Option<Instant> {
        self.outstanding.front().map(|(_, at)| *at + timeout)
    }
}

/// Reads one client text frame (`docs/relay-stream.md` "Frames").
fn read_frame(text: &str) -> Asked {
    if text.len() > MAX_CLIENT_FRAME {
        return Asked::Close(close::OVERSIZE);
    }
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
        return Asked::Close(close::POLICY);
    };
    let Some(kind) = value.get("type").and_then(serde_json::Value::as_str) else {
        return Asked::Close(close::POLICY);
    };
    let kind = kind.to_owned();
    match serde_json::from_value::<ClientFrame>(value) {
        Ok(ClientFrame::Resume { epoch, after }) => Asked::Resume { epoch, after },
        Ok(ClientFrame::Pong { id }) => Asked::Pong(id),
        Err(_) if kind == "resume" || kind == "pong" => {
            Asked::Answer(frame_text(&ServerFrame::Error {
                reason: "bad_frame".into(),
                frame_type: Some(kind),
                detail: Some("resume {epoch, after} or pong {id} expected".into()),
            }))
        }
        Err(_) => {
            // Only a short, printable type is echoed back.
            let shown: String = kind.chars().take(64).filter(|c| !c.is_control()).collect();
            tracing::debug!(frame_type = %shown, "push stream: unknown client frame");
            Asked::Answer(frame_text(&ServerFrame::Error {
                reason: "unknown_frame".into(),
                frame_type: Some(shown),
                detail: Some("the relay reads resume and pong frames only".into()),
            }))
        }
    }
}

/// How a read error ends the stream: a client frame over the size limit closes with
/// [`close::OVERSIZE`], invalid UTF-8 in a text frame or a WebSocket protocol violation with
/// [`close::POLICY`]; anything else (the socket failed) without a close.
fn read_error_end(e: axum::Error) -> Ended {
    let inner = e.into_inner();
    match inner.downcast_ref::<tungstenite::Error>() {
        Some(tungstenite::Error::Capacity(_)) => Ended::Closed(close::OVERSIZE),
        Some(tungstenite::Error::Utf8(_) | tungstenite::Error::Protocol(_)) => {
            Ended::Closed(close::POLICY)
        }
        _ => Ended::Gone,
    }
}

/// Pings between two reads of the key's enrolment and deny entries
/// ([`super::key_may_stream`]) on an idle stream: every 4th ping (about 100 s at the
/// contract's timers). Every `resume` reads them too.
pub const RECHECK_EVERY_PINGS: u64 = 4;

/// What the key's re-read found: `Err(4403)` when it may no longer stream, `Err(1013)` when
/// the store could not be read.
fn key_check(
    store: &dyn RelayStore,
    key: &str,
    fingerprint: &str,
    client_id: Option<&str>,
    now_ms: i64,
) -> Result<(), u16> {
    match super::key_may_stream(store, key, fingerprint, client_id, now_ms) {
        Ok(true) => Ok(()),
        Ok(false) => Err(close::AUTH),
        Err(e) => {
            tracing::warn!(error = %e, "push stream: the key's status could not be read again");
            Err(close::OVERLOAD)
        }
    }
}

/// Reads the key's enrolment and deny entries again, off the runtime: `Err(code)` closes.
async fn recheck_key(params: &ConnParams, stream: &Stream) -> Result<(), u16> {
    let store = params.store.clone();
    let (key, fp, client) = (
        stream.key.clone(),
        stream.fingerprint.clone(),
        stream.client_id.clone(),
    );
    let now = params.clock.now_ms();
    tokio::task::spawn_blocking(move || {
        key_check(store.as_ref(), &key, &fp, client.as_deref(), now)
    })
    .await
    .unwrap_or(Err(close::OVERLOAD))
}

/// Reads the replay's next chunk after `after` (at most `limit` items, `max_bytes` wire bytes)
/// for `stream`'s key. With `recheck` (a `resume`), the key's enrolment and deny entries are
/// read first in the same blocking call: a revoked or denied key gets `Err(4403)`, not its
/// queue.
async fn read_chunk(
    params: &ConnParams,
    stream: &Stream,
    recheck: bool,
    after: i64,
    limit: i64,
    max_bytes: u64,
) -> Result<PullPage, u16> {
    let store = params.store.clone();
    let req = PullRequest {
        target_pubkey: stream.key.clone(),
        after,
        limit: limit.max(1),
        max_bytes: max_bytes.max(1),
    };
    let check = recheck.then(|| {
        (
            stream.fingerprint.clone(),
            stream.client_id.clone(),
            params.clock.now_ms(),
        )
    });
    let read = tokio::task::spawn_blocking(move || {
        if let Some((fp, client, now)) = check {
            key_check(
                store.as_ref(),
                &req.target_pubkey,
                &fp,
                client.as_deref(),
                now,
            )?;
        }
        store.pull(req).map_err(|e| {
            tracing::warn!(error = %e, "push stream replay could not read the store");
            close::OVERLOAD
        })
    });
    read.await.unwrap_or(Err(close::OVERLOAD))
}

/// Takes `page` as the replay's next chunk: items up to the first one whose frame would not fit
/// the socket ([`ConnParams::max_frame_bytes`]; the replay ends before it, a pull carries it),
/// their frame bytes reserved from the budget, and tells the hub how far the replay has read
/// ([`Hub::replay_read`]: live frames up to there are the replay's). When the relay-wide
/// budget cannot give them, the
/// replay ends here (its `resume_complete` names the head, so the client pulls the rest over
/// HTTP) instead of closing the stream: many streams resuming at once after a restart are not
/// turned into reconnects.
fn take_chunk(
    hub: &Hub,
    stream: &Stream,
    params: &ConnParams,
    replay: &mut Replay,
    page: PullPage,
) {
    replay.head_seq = page.head_seq;
    replay.more = page.more;
    let mut reserve = 0usize;
    for item in page.items {
        let n = frame_bytes(&item);
        if n > params.max_frame_bytes {
            replay.last = true;
            break;
        }
        reserve = reserve.saturating_add(n);
        replay.chunk.push_back(item);
    }
    if !hub.reserve_bytes(reserve) {
        tracing::debug!(
            bytes = reserve,
            "push stream: the relay-wide budget is full; the replay ends early and the client pulls"
        );
        replay.chunk.clear();
        replay.last = true;
        return;
    }
    replay.reserved = replay.reserved.saturating_add(reserve);
    if let Some(last) = replay.chunk.back() {
        hub.replay_read(stream, last.seq);
    }
}

/// Runs the stream until it closes; `reg` is dropped at the end (unregistering the stream and
/// returning its queued bytes to the budget). `hold` is kept alive exactly as long (the
/// connection's slot among `max_connections`, and its count among the running streams that
/// shutdown waits for).
pub async fn run<H: Send>(
    socket: WebSocket,
    reg: Registration,
    params: ConnParams,
    hold: H,
) -> Ended {
    let hub = reg.hub().clone();
    let stream = reg.stream.clone();
    let (mut sink, mut rx) = socket.split();
    let mut ping = tokio::time::interval_at(Instant::now() + params.ping_every, params.ping_every);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pings = Pings::default();
    let mut pings_sent: u64 = 0;
    let mut allowance = Allowance::new(Instant::now());
    let mut control: VecDeque<String> = VecDeque::new();
    let mut replay = Replay::default();
    // Live frames up to this seq were sent by the replay (or the client has them).
    let mut skip_through: i64 = i64::MAX;
    let mut dirty = false;
    // A frame was just read: with frames to write, the next turn writes before it reads again,
    // so a client that keeps sending is answered (and, when it does not read, held back by
    // TCP) instead of starving the writes.
    let mut just_read = false;
    let max_pull = params.max_pull.clamp(1, MAX_PULL_ITEMS);

    let ended = loop {
        if let Some(code) = stream.close_requested() {
            break Ended::Closed(code);
        }
        let now = Instant::now();
        let mut deadline: Option<Instant> = None;
        if let Some(exp) = params.token_exp_ms {
            let left = exp.saturating_sub(params.clock.now_ms());
            if left <= 0 {
                break Ended::Closed(close::TOKEN_EXPIRED);
            }
            deadline = Some(
                now + Duration::from_millis(
                    u64::try_from(left).unwrap_or(u64::MAX).min(86_400_000),
                ),
            );
        }
        if let Some(due) = pings.deadline(params.pong_timeout) {
            if now >= due {
                break Ended::Closed(close::POLICY);
            }
            deadline = Some(deadline.map_or(due, |d| d.min(due)));
        }
        let has_out =
            !control.is_empty() || replay.active || stream.has_frames() || stream.has_epoch();
        // While the answers wait (the client does not read them), nothing more is read.
        let may_read = control.len() < MAX_CONTROL_FRAMES && !(has_out && just_read);
        tokio::select! {
            biased;
            _ = ping.tick() => {
                pings_sent += 1;
                if pings_sent.is_multiple_of(RECHECK_EVERY_PINGS) {
                    // A revocation or deny whose close request never reached this stream.
                    if let Err(code) = recheck_key(&params, &stream).await {
                        break Ended::Closed(code);
                    }
                }
                let id = pings.send(Instant::now());
                if control.len() < MAX_CONTROL_FRAMES {
                    control.push_back(frame_text(&ServerFrame::Ping { id }));
                }
            }
            () = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            }, if deadline.is_some() => {}
            read = rx.next(), if may_read => { just_read = true; match read {
                None => break Ended::Gone,
                Some(Err(e)) => break read_error_end(e),
                Some(Ok(Message::Binary(_))) => break Ended::Closed(close::POLICY),
                Some(Ok(Message::Close(_))) => break Ended::Gone,
                // Protocol-level pings are answered by the WebSocket layer.
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Text(text))) => match read_frame(text.as_str()) {
                    Asked::Close(code) => break Ended::Closed(code),
                    Asked::Answer(frame) => {
                        if !allowance.take(Instant::now()) {
                            break Ended::Closed(close::POLICY);
                        }
                        control.push_back(frame);
                    }
                    Asked::Pong(id) => pings.answer(id),
                    Asked::Resume { epoch, after } => {
                        let refused = if replay.active {
                            Some("a replay is running: resume again after its resume_complete")
                        } else if after < 0 {
                            Some("after must be 0 or more")
                        } else {
                            None
                        };
                        if let Some(detail) = refused {
                            if !allowance.take(Instant::now()) {
                                break Ended::Closed(close::POLICY);
                            }
                            control.push_back(frame_text(&ServerFrame::Error {
                                reason: "bad_frame".into(),
                                frame_type: Some("resume".into()),
                                detail: Some(detail.into()),
                            }));
                            continue;
                        }
                        // Live first, then the page: an item committed in between is in the
                        // queue or in the page (or both: the queue skips what the page sent).
                        hub.reset(&stream, true);
                        skip_through = i64::MAX;
                        let page = match read_chunk(
                            &params,
                            &stream,
                            true,
                            after,
                            max_pull,
                            params.max_pull_bytes.min(REPLAY_CHUNK_BYTES),
                        )
                        .await
                        {
                            Ok(page) => page,
                            Err(code) => break Ended::Closed(code),
                        };
                        if !epoch.is_empty() && epoch != page.epoch {
                            hub.reset(&stream, false);
                            control.push_back(frame_text(&ServerFrame::Epoch { epoch: page.epoch }));
                        } else {
                            replay = Replay {
                                active: true,
                                epoch: page.epoch.clone(),
                                prev_seq: after,
                                ..Replay::default()
                            };
                            take_chunk(&hub, &stream, &params, &mut replay, page);
                        }
                    }
                },
            } },
            // With frames to write: wait until the socket takes one. Without: flush.
            done = std::future::poll_fn(|cx| if has_out {
                sink.poll_ready_unpin(cx)
            } else {
                sink.poll_flush_unpin(cx)
            }), if has_out || dirty => {
                just_read = false;
                if done.is_err() {
                    break Ended::Gone;
                }
                if !has_out {
                    dirty = false;
                    continue;
                }
                let next = next_frame(
                    &hub,
                    &stream,
                    &params,
                    max_pull,
                    &mut control,
                    &mut replay,
                    &mut skip_through,
                )
                .await;
                let text = match next {
                    Ok(Some(text)) => text,
                    Ok(None) => continue,
                    Err(code) => break Ended::Closed(code),
                };
                if sink.start_send_unpin(Message::Text(Utf8Bytes::from(text))).is_err() {
                    break Ended::Gone;
                }
                dirty = true;
            }
            // Last: a burst of publishes never keeps the branches above from being polled.
            () = stream.wake.notified() => {}
        }
    };
    hub.release_bytes(std::mem::take(&mut replay.reserved));
    match ended {
        Ended::Closed(code) => {
            hub.count_close(code);
            let frame = Message::Close(Some(CloseFrame {
                code,
                reason: Utf8Bytes::from_static(close_reason(code)),
            }));
            let _ = tokio::time::timeout(CLOSE_WRITE_LIMIT, async {
                let _ = sink.send(frame).await;
                let _ = sink.close().await;
            })
            .await;
        }
        // The client closed (its close is answered by the WebSocket layer: flush it) or the
        // socket failed (this returns at once).
        Ended::Gone => {
            let _ = tokio::time::timeout(CLOSE_WRITE_LIMIT, sink.close()).await;
        }
    }
    drop(reg);
    drop(hold);
    ended
}

/// The next frame to write: control frames (ping, error, epoch answers) first, then an `epoch`
/// announced by the hub (it ends a running replay: the client resumes in the new epoch), then
/// the replay (reading its next chunk once the previous one was written) and its
/// `resume_complete`, then the live queue (skipping seqs the replay sent). `Err(code)`: close.
async fn next_frame(
    hub: &Hub,
    stream: &Stream,
    params: &ConnParams,
    max_pull: i64,
    control: &mut VecDeque<String>,
    replay: &mut Replay,
    skip_through: &mut i64,
) -> Result<Option<String>, u16> {
    if let Some(c) = control.pop_front() {
        return Ok(Some(c));
    }
    if let Some(epoch) = hub.take_epoch(stream) {
        hub.release_bytes(std::mem::take(&mut replay.reserved));
        *replay = Replay::default();
        *skip_through = i64::MAX;
        return Ok(Some(epoch));
    }
    if !replay.active {
        while let Some(f) = hub.pop(stream) {
            if f.marker || f.seq > *skip_through {
                return Ok(Some(f.text));
            }
        }
        return Ok(None);
    }
    let max_items = u64::try_from(max_pull).unwrap_or(1);
    if replay.chunk.is_empty()
        && !replay.last
        && replay.more
        && replay.sent < max_items
        && replay.sent_bytes < params.max_pull_bytes
    {
        let left_items = i64::try_from(max_items - replay.sent).unwrap_or(1);
        let left_bytes = (params.max_pull_bytes - replay.sent_bytes).min(REPLAY_CHUNK_BYTES);
        let page = read_chunk(
            params,
            stream,
            false,
            replay.prev_seq,
            left_items,
            left_bytes,
        )
        .await?;
        if page.epoch != replay.epoch {
            // The epoch changed under the replay: the hub announces it; stop here.
            replay.more = false;
        } else {
            take_chunk(hub, stream, params, replay, page);
        }
    }
    if let Some(item) = replay.chunk.pop_front() {
        let n = frame_bytes(&item);
        replay.reserved = replay.reserved.saturating_sub(n);
        hub.release_bytes(n);
        let prev = replay.prev_seq;
        replay.prev_seq = item.seq;
        replay.sent += 1;
        replay.sent_bytes = replay.sent_bytes.saturating_add(item.wire.len() as u64);
        return Ok(Some(frame_text(&ServerFrame::Deliver {
            seq: item.seq,
            prev_seq: prev,
            kind: item.kind,
            item_id: item.item_id,
            sender_pubkey: item.sender_pubkey,
            wire_b64: agentmbx_protocol::b64::encode(&item.wire),
            replay: true,
        })));
    }
    // The replay ended: its bound, the head, an item too large for a frame or a full budget (a
    // pull carries the rest). Live frames up to the last replayed seq are not sent again; live
    // frames dropped while it ran and not replayed are told with `lagged` after the queue.
    replay.active = false;
    *skip_through = replay.prev_seq;
    hub.end_replay(stream, replay.prev_seq);
    Ok(Some(frame_text(&ServerFrame::ResumeComplete {
        replayed: replay.sent,
        head_seq: replay.head_seq,
    })))
}

/// The close frame's reason text for `code`.
pub fn close_reason(code: u16) -> &'static str {
    match code {
        close::GOING_AWAY => "going away",
        close::POLICY => "policy",
        close::OVERSIZE => "frame too large",
        close::OVERLOAD => "overload",
        close::TOKEN_EXPIRED => "token expired",
        close::AUTH => "revoked or denied",
        close::REPLACED => "replaced",
        _ => "closed",
    }
}
