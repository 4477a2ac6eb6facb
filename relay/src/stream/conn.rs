//! One push stream's connection loop (`docs/relay-stream.md` "Frames", "Order and gaps",
//! "Close codes"), run on the task axum's upgrade spawned: that one task per connection, no
//! other task and no timer but the ping interval (plus a deadline only while a ping is
//! unanswered or an account token bounds the stream).
//!
//! # What it owns
//! Reading client frames (`resume`, `pong`; anything else is answered `error`), the replay of
//! one pull page after a `resume`, the ping and its pong deadline, the account token's expiry,
//! writing the queued live frames ([`super::hub`]) and the close with its code.
//!
//! Each iteration of the loop first looks at the control side (a close request, the token
//! deadline, the ping, the pong deadline), then reads or writes at most one frame (after a
//! read, a pending write goes first), so a sustained flow of `deliver` frames never starves
//! pings, deadlines or close requests, and a client that keeps sending never starves the
//! writes.
//! Writing uses the sink's readiness (cancel-safe): a frame is taken from the queue only once
//! the socket can take it, so a slow reader leaves frames in the bounded queue, where the
//! publish path turns the overflow into `lagged`.
//!
//! # What it must never do
//! Send a live frame for a seq the replay already sent, send live frames before the replay
//! and its `resume_complete`, or buffer a client frame over [`MAX_CLIENT_FRAME`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use futures_util::{SinkExt, StreamExt};
use tokio::time::Instant;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::stream::{close, ClientFrame, ServerFrame, MAX_CLIENT_FRAME};

use super::hub::{frame_text, Registration};
use crate::store::{PullRequest, PulledItem, RelayStore, MAX_PULL_ITEMS};

/// Control frames (pings, `error` answers, `epoch`) waiting to be written, at most: a client
/// that keeps sending frames the relay answers, without reading the answers, is closed with
/// [`close::POLICY`] instead of growing this queue.
pub const MAX_CONTROL_FRAMES: usize = 64;

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
}

/// How a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The relay closed it with this code.
    Closed(u16),
    /// The client closed it, or the socket failed.
    Gone,
}

/// The replay in progress after a `resume`.
#[derive(Debug, Default)]
struct Replay {
    items: VecDeque<PulledItem>,
    prev_seq: i64,
    /// `resume_complete`, sent after the last replayed item.
    complete: Option<String>,
}

/// What one client text frame asks for.
enum Asked {
    Resume { epoch: String, after: i64 },
    Pong(u64),
    Answer(String),
    Close(u16),
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
            Asked::Answer(frame_text(&ServerFrame::Error {
                reason: "unknown_frame".into(),
                frame_type: Some(shown),
                detail: None,
            }))
        }
    }
}

/// Whether a read error is a client frame over the size limit.
fn is_oversize(e: axum::Error) -> bool {
    let inner = e.into_inner();
    matches!(
        inner.downcast_ref::<tungstenite::Error>(),
        Some(tungstenite::Error::Capacity(_))
    )
}

/// Runs the stream until it closes; `reg` is dropped at the end (unregistering the stream and
/// returning its queued bytes to the budget). `hold` is kept alive exactly as long (the
/// connection's slot among `max_connections`).
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
    let mut ping_id: u64 = 0;
    // The first unanswered ping: its id and when it was sent.
    let mut unanswered: Option<(u64, Instant)> = None;
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
        if let Some((_, since)) = unanswered {
            let due = since + params.pong_timeout;
            if now >= due {
                break Ended::Closed(close::POLICY);
            }
            deadline = Some(deadline.map_or(due, |d| d.min(due)));
        }
        if control.len() > MAX_CONTROL_FRAMES {
            break Ended::Closed(close::POLICY);
        }
        let replaying = !replay.items.is_empty() || replay.complete.is_some();
        let has_out = !control.is_empty() || replaying || stream.has_frames();
        tokio::select! {
            biased;
            () = stream.wake.notified() => {}
            _ = ping.tick() => {
                ping_id += 1;
                control.push_back(frame_text(&ServerFrame::Ping { id: ping_id }));
                if unanswered.is_none() {
                    unanswered = Some((ping_id, Instant::now()));
                }
            }
            () = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            }, if deadline.is_some() => {}
            read = rx.next(), if !(has_out && just_read) => { just_read = true; match read {
                None => break Ended::Gone,
                Some(Err(e)) => {
                    if is_oversize(e) {
                        break Ended::Closed(close::OVERSIZE);
                    }
                    break Ended::Gone;
                }
                Some(Ok(Message::Binary(_))) => break Ended::Closed(close::POLICY),
                Some(Ok(Message::Close(_))) => break Ended::Gone,
                // Protocol-level pings are answered by the WebSocket layer.
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Text(text))) => match read_frame(text.as_str()) {
                    Asked::Close(code) => break Ended::Closed(code),
                    Asked::Answer(frame) => control.push_back(frame),
                    Asked::Pong(id) => {
                        if let Some((first, _)) = unanswered {
                            if id >= first && id <= ping_id {
                                unanswered = (id < ping_id).then(|| (id + 1, Instant::now()));
                            }
                        }
                    }
                    Asked::Resume { epoch, after } => {
                        // Live first, then the page: an item committed in between is in the
                        // queue or in the page (or both: the queue skips what the page sent).
                        hub.reset(&stream, true);
                        let after = after.max(0);
                        let store = params.store.clone();
                        let req = PullRequest {
                            target_pubkey: stream.key.clone(),
                            after,
                            limit: max_pull,
                            max_bytes: params.max_pull_bytes,
                        };
                        let page = match tokio::task::spawn_blocking(move || store.pull(req)).await {
                            Ok(Ok(page)) => page,
                            Ok(Err(e)) => {
                                tracing::warn!(error = %e, "push stream replay could not read the store");
                                break Ended::Closed(close::OVERLOAD);
                            }
                            Err(_) => break Ended::Closed(close::OVERLOAD),
                        };
                        if !epoch.is_empty() && epoch != page.epoch {
                            hub.reset(&stream, false);
                            replay = Replay::default();
                            skip_through = i64::MAX;
                            control.push_back(frame_text(&ServerFrame::Epoch { epoch: page.epoch }));
                        } else {
                            skip_through = page.last_seq;
                            replay = Replay {
                                complete: Some(frame_text(&ServerFrame::ResumeComplete {
                                    replayed: page.items.len() as u64,
                                    head_seq: page.head_seq,
                                })),
                                items: page.items.into(),
                                prev_seq: after,
                            };
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
                let Some(text) = next_frame(&hub, &stream, &mut control, &mut replay, skip_through) else {
                    continue;
                };
                if sink.start_send_unpin(Message::Text(Utf8Bytes::from(text))).is_err() {
                    break Ended::Gone;
                }
                dirty = true;
            }
        }
    };
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

/// The next frame to write: control frames (ping, error, epoch) first, then the replay and its
/// `resume_complete`, then the live queue (skipping seqs the replay sent).
fn next_frame(
    hub: &super::hub::Hub,
    stream: &super::hub::Stream,
    control: &mut VecDeque<String>,
    replay: &mut Replay,
    skip_through: i64,
) -> Option<String> {
    if let Some(c) = control.pop_front() {
        return Some(c);
    }
    if let Some(item) = replay.items.pop_front() {
        let prev = replay.prev_seq;
        replay.prev_seq = item.seq;
        return Some(frame_text(&ServerFrame::Deliver {
            seq: item.seq,
            prev_seq: prev,
            kind: item.kind,
            item_id: item.item_id,
            sender_pubkey: item.sender_pubkey,
            wire_b64: agentmbx_protocol::b64::encode(&item.wire),
            replay: true,
        }));
    }
    if let Some(done) = replay.complete.take() {
        return Some(done);
    }
    while let Some(f) = hub.pop(stream) {
        if f.marker || f.seq > skip_through {
            return Some(f.text);
        }
    }
    None
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
