//! The registry of open push streams and the publish path (`docs/relay-stream.md` "Bounds").
//!
//! # What it owns
//! One entry per host key with an open stream (a new stream for the key replaces the old one,
//! which is asked to close with 4409), each with its bounded send queue of frame texts; the
//! relay-wide byte budget all queues draw from ([`RELAY_STREAM_BUDGET_BYTES`]); the close
//! requests (revocation, deny, rotation, shutdown) and the stream counters of admin stats.
//!
//! Publishing ([`Hub::publish`]) only takes a short lock and appends to a queue: it never
//! waits for a socket, so the store's writer and the push handler never block on a slow
//! reader. When a queue ([`STREAM_QUEUE_BYTES`]) or the budget is full the live frame is
//! dropped (never the stored item) and one `lagged {from_seq}` marker is queued instead; the
//! stream then drops every live frame until its client sends `resume` again. While a replay
//! runs, the marker waits for its end ([`Hub::end_replay`]): it is sent only when the replay
//! did not carry every dropped seq.
//!
//! # What it must never do
//! Touch the store or a socket, or publish a frame before the transaction that stored its item
//! committed (callers publish after the commit).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use agentmbx_protocol::stream::{ServerFrame, RELAY_STREAM_BUDGET_BYTES, STREAM_QUEUE_BYTES};

/// A committed item for one target, as its live `deliver` frame needs it.
#[derive(Debug, Clone)]
pub struct LiveItem {
    /// Relay seq in the target's queue.
    pub seq: i64,
    /// The target's head just before `seq` was allocated (same transaction).
    pub prev_seq: i64,
    /// `envelope`, `receipt` or `expired`.
    pub kind: String,
    /// Item id.
    pub item_id: String,
    /// The pushing host key (the relay key for notices).
    pub sender_pubkey: String,
    /// The stored wire bytes.
    pub wire: bytes::Bytes,
}

impl LiveItem {
    /// The item's live `deliver` frame as JSON text.
    pub fn frame(&self) -> String {
        frame_text(&ServerFrame::Deliver {
            seq: self.seq,
            prev_seq: self.prev_seq,
            kind: self.kind.clone(),
            item_id: self.item_id.clone(),
            sender_pubkey: self.sender_pubkey.clone(),
            wire_b64: agentmbx_protocol::b64::encode(&self.wire),
            replay: false,
        })
    }
}

/// A server frame as JSON text (serializing these shapes cannot fail; `{}` if it did).
pub fn frame_text(frame: &ServerFrame) -> String {
    serde_json::to_string(frame).unwrap_or_else(|_| "{}".to_owned())
}

/// One queued frame.
#[derive(Debug)]
pub struct Queued {
    /// The seq of a `deliver` frame (the `lagged` marker carries its `from_seq`).
    pub seq: i64,
    /// Whether it is a marker (`lagged`, `epoch`): sent even when its seq was replayed.
    pub marker: bool,
    /// The frame's JSON text.
    pub text: String,
}

#[derive(Debug, Default)]
struct Queue {
    frames: VecDeque<Queued>,
    bytes: usize,
    /// The client sent `resume` (with the current epoch): live frames are queued.
    live: bool,
    /// A `lagged` marker was queued: drop live frames until the next `resume`.
    lagged: bool,
    /// A replay runs (from the `resume` until its `resume_complete`): a live frame that does
    /// not fit is dropped without a marker, since the replay may still send its seq;
    /// [`Hub::end_replay`] queues `lagged` only for what the replay did not send.
    replaying: bool,
    /// The first and the last seq dropped while `replaying` (every live frame after the first
    /// drop is dropped too, so the queue never skips a seq it then sends).
    dropped: Option<(i64, i64)>,
    /// The running replay has read its items up to this seq ([`Hub::replay_read`]): live
    /// frames at or below it are the replay's to send and are not queued.
    floor: i64,
    /// The stream's registration was dropped: nothing is queued any more (no bytes of the
    /// budget can be left behind).
    closed: bool,
    /// An `epoch` frame announced by [`Hub::announce_epoch`], written before anything but the
    /// control answers; it ends a running replay. Not counted in the budget (one short frame
    /// per stream, replaced, never accumulated).
    epoch: Option<String>,
}

/// One open stream, shared by the hub (publishers, close requests) and its connection loop.
#[derive(Debug)]
pub struct Stream {
    /// Unique per relay process (a replaced stream and its successor differ).
    pub id: u64,
    /// The host key (canonical base64).
    pub key: String,
    /// The key's fingerprint (what a deny entry of kind `fingerprint` names).
    pub fingerprint: String,
    /// The account token's `client_id` the stream was opened under (account relays).
    pub client_id: Option<String>,
    queue: Mutex<Queue>,
    /// Woken when a frame is queued or a close is requested.
    pub wake: tokio::sync::Notify,
    /// The close code asked for (0: none yet; the first request wins).
    close: AtomicU16,
}

impl Stream {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The close code asked for, if any.
    pub fn close_requested(&self) -> Option<u16> {
        match self.close.load(Ordering::Acquire) {
            0 => None,
            code => Some(code),
        }
    }

    /// Asks the connection loop to close with `code` (the first request wins).
    pub fn request_close(&self, code: u16) {
        let _ = self
            .close
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
        self.wake.notify_one();
    }

    /// Whether frames are queued.
    pub fn has_frames(&self) -> bool {
        !self.lock().frames.is_empty()
    }

    /// Whether an announced `epoch` frame waits.
    pub fn has_epoch(&self) -> bool {
        self.lock().epoch.is_some()
    }

    /// Bytes of frames queued.
    pub fn queued_bytes(&self) -> usize {
        self.lock().bytes
    }
}

/// One stream connection counted as running from before its `101` answer until its loop ends
/// (or the upgrade never completes): [`Hub::all_ended`] waits for it, so a stream answered just
/// as shutdown starts still gets its 1001.
#[derive(Debug)]
pub struct Running {
    hub: Arc<Hub>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.hub.running.fetch_sub(1, Ordering::AcqRel);
        self.hub.ended.notify_waiters();
    }
}

/// Counters of admin stats `streams`.
#[derive(Debug, Default)]
struct Counters {
    opened: AtomicU64,
    lagged: AtomicU64,
    dropped_frames: AtomicU64,
    closes: Mutex<BTreeMap<u16, u64>>,
}

/// The registry ([module docs](self)).
#[derive(Debug)]
pub struct Hub {
    streams: Mutex<HashMap<String, Arc<Stream>>>,
    budget_cap: usize,
    budget_used: AtomicUsize,
    next_id: AtomicU64,
    /// Connection loops running (registered or winding down after a replacement).
    running: AtomicUsize,
    ended: tokio::sync::Notify,
    /// Set by [`Hub::shut_down`]: a stream registered afterwards closes at once (1001).
    closing: AtomicBool,
    /// Ping period and pong timeout of streams opened from now on, in ms.
    ping_ms: AtomicU64,
    pong_ms: AtomicU64,
    counters: Counters,
    /// Held across an epoch rotation's commit and its announcement ([`Hub::epoch_turn`]).
    epoch_turn: Mutex<()>,
}

impl Default for Hub {
    fn default() -> Self {
        Hub::with_budget(RELAY_STREAM_BUDGET_BYTES)
    }
}

impl Hub {
    /// A hub whose streams may queue `budget` bytes together (the relay uses
    /// [`RELAY_STREAM_BUDGET_BYTES`]).
    pub fn with_budget(budget: usize) -> Self {
        Hub {
            streams: Mutex::new(HashMap::new()),
            budget_cap: budget,
            budget_used: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            running: AtomicUsize::new(0),
            ended: tokio::sync::Notify::new(),
            closing: AtomicBool::new(false),
            ping_ms: AtomicU64::new(agentmbx_protocol::stream::PING_EVERY_MS),
            pong_ms: AtomicU64::new(agentmbx_protocol::stream::PONG_TIMEOUT_MS),
            counters: Counters::default(),
            epoch_turn: Mutex::new(()),
        }
    }

    /// The turn of one epoch rotation: hold it across the rotation's commit and its
    /// [`Hub::announce_epoch`], so that two rotations announce in the order they committed
    /// (the last `epoch` frame a stream gets names the current epoch). Blocking: take it on a
    /// blocking thread, never on the async runtime.
    pub fn epoch_turn(&self) -> std::sync::MutexGuard<'_, ()> {
        self.epoch_turn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Stream>>> {
        self.streams
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers a new stream for `key` and returns it with the guard that unregisters it (and
    /// returns its queued bytes to the budget) when dropped. An open stream for the same key is
    /// asked to close with [`close::REPLACED`](agentmbx_protocol::stream::close::REPLACED).
    pub fn register(
        self: &Arc<Self>,
        key: &str,
        fingerprint: &str,
        client_id: Option<String>,
    ) -> Registration {
        let stream = Arc::new(Stream {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            key: key.to_owned(),
            fingerprint: fingerprint.to_owned(),
            client_id,
            queue: Mutex::new(Queue::default()),
            wake: tokio::sync::Notify::new(),
            close: AtomicU16::new(0),
        });
        self.counters.opened.fetch_add(1, Ordering::Relaxed);
        let old = self.map().insert(key.to_owned(), stream.clone());
        if let Some(old) = old {
            old.request_close(agentmbx_protocol::stream::close::REPLACED);
        }
        if self.closing.load(Ordering::Acquire) {
            stream.request_close(agentmbx_protocol::stream::close::GOING_AWAY);
        }
        Registration {
            hub: self.clone(),
            stream,
        }
    }

    /// Counts a stream connection as running (before its `101`); the guard moves into the
    /// connection loop and ends the count when dropped.
    pub fn start_running(self: &Arc<Self>) -> Running {
        self.running.fetch_add(1, Ordering::AcqRel);
        Running { hub: self.clone() }
    }

    /// Publishes a committed item to `target`'s stream, if one is open and live. Never waits;
    /// an item whose frame cannot fit the queue is `lagged` without encoding it (during a
    /// replay: dropped, and [`Hub::end_replay`] decides).
    pub fn publish(&self, target: &str, item: &LiveItem) {
        let Some(stream) = self.map().get(target).cloned() else {
            return;
        };
        let too_large = {
            let mut q = stream.lock();
            if !self.may_queue(&mut q, item.seq) {
                return;
            }
            // The frame's length before encoding it: base64 of the wire plus the fields.
            let encoded = item.wire.len().saturating_add(2) / 3 * 4;
            encoded.saturating_add(q.bytes) > STREAM_QUEUE_BYTES
        };
        // The frame is built outside the lock (base64 of the wire).
        let text = if too_large {
            String::new()
        } else {
            item.frame()
        };
        let n = text.len();
        let mut q = stream.lock();
        if !self.may_queue(&mut q, item.seq) {
            return;
        }
        if too_large || q.bytes.saturating_add(n) > STREAM_QUEUE_BYTES || !self.reserve(n) {
            self.counters.dropped_frames.fetch_add(1, Ordering::Relaxed);
            if q.replaying {
                q.dropped = Some((item.seq, item.seq));
                return;
            }
            self.queue_lagged(&mut q, item.seq);
        } else {
            q.bytes += n;
            q.frames.push_back(Queued {
                seq: item.seq,
                marker: false,
                text,
            });
        }
        drop(q);
        stream.wake.notify_one();
    }

    /// Whether a live frame for `seq` may be queued: the stream is open, live and not
    /// `lagged`, the running replay has not read `seq` already, and no live frame was dropped
    /// during the running replay (a later one is dropped too and noted in [`Queue::dropped`]).
    fn may_queue(&self, q: &mut Queue, seq: i64) -> bool {
        if q.closed || !q.live || q.lagged || seq <= q.floor {
            return false;
        }
        if let Some((_, last)) = q.dropped.as_mut() {
            *last = (*last).max(seq);
            return false;
        }
        true
    }

    /// Queues the `lagged {from_seq}` marker and drops live frames until the next `resume`.
    fn queue_lagged(&self, q: &mut Queue, from_seq: i64) {
        q.lagged = true;
        let marker = frame_text(&ServerFrame::Lagged { from_seq });
        // The marker is a few dozen bytes: counted, never refused.
        self.budget_used.fetch_add(marker.len(), Ordering::AcqRel);
        q.bytes += marker.len();
        q.frames.push_back(Queued {
            seq: from_seq,
            marker: true,
            text: marker,
        });
        self.counters.lagged.fetch_add(1, Ordering::Relaxed);
    }

    /// The running replay of `stream` read its items up to `through` (a chunk it will write):
    /// queued live frames at or below it are dropped (the replay sends them) and later ones are
    /// not queued; once every live frame dropped during the replay is at or below it, the
    /// queue takes live frames again. Called with the last seq of each chunk read.
    pub fn replay_read(&self, stream: &Stream, through: i64) {
        let mut q = stream.lock();
        let freed = Self::cover(&mut q, through);
        drop(q);
        self.release(freed);
    }

    /// [`Hub::replay_read`] under the lock; returns the bytes to give back to the budget.
    fn cover(q: &mut Queue, through: i64) -> usize {
        if !q.replaying {
            return 0;
        }
        q.floor = q.floor.max(through);
        let before = q.bytes;
        q.frames.retain(|f| f.marker || f.seq > through);
        q.bytes = q.frames.iter().map(|f| f.text.len()).sum();
        if matches!(q.dropped, Some((_, last)) if last <= through) {
            q.dropped = None;
        }
        before.saturating_sub(q.bytes)
    }

    /// The replay of `stream` ended (its `resume_complete` is being written) with `through`,
    /// the last seq it sent (the `resume`'s `after` when it sent none). Live frames dropped
    /// while it ran that it did not send are told with `lagged {from_seq}`, queued after the
    /// live frames the queue holds; no seq the client lacks is below `from_seq` (the first
    /// dropped seq, or `through + 1` when the replay sent the first ones). When the replay
    /// sent every dropped seq, nothing is told.
    pub fn end_replay(&self, stream: &Stream, through: i64) {
        let mut q = stream.lock();
        let freed = Self::cover(&mut q, through);
        q.replaying = false;
        let tell = match q.dropped.take() {
            Some((first, _)) if !q.closed && q.live && !q.lagged => {
                Some(first.max(through.saturating_add(1)))
            }
            _ => None,
        };
        if let Some(from_seq) = tell {
            self.queue_lagged(&mut q, from_seq);
        }
        drop(q);
        self.release(freed);
        if tell.is_some() {
            stream.wake.notify_one();
        }
    }

    /// Takes `n` bytes from the relay-wide budget; false when they do not fit.
    fn reserve(&self, n: usize) -> bool {
        self.budget_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let after = used.checked_add(n)?;
                (after <= self.budget_cap).then_some(after)
            })
            .is_ok()
    }

    /// Takes `n` bytes from the relay-wide budget for a replay chunk; false when they do not
    /// fit (the replay ends there with `resume_complete` and the client pulls).
    pub fn reserve_bytes(&self, n: usize) -> bool {
        self.reserve(n)
    }

    /// Returns `n` bytes taken by [`Hub::reserve_bytes`].
    pub fn release_bytes(&self, n: usize) {
        self.release(n);
    }

    fn release(&self, n: usize) {
        let _ = self
            .budget_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(n))
            });
    }

    /// Empties `stream`'s queue and sets whether it is live (a `resume` with the current epoch:
    /// true, which also drops an announced `epoch` frame the `resume` makes moot, and starts
    /// its replay; a stale epoch: false). Clears the lagged state.
    pub fn reset(&self, stream: &Stream, live: bool) {
        let mut q = stream.lock();
        let freed = q.bytes;
        q.frames.clear();
        q.bytes = 0;
        q.live = live && !q.closed;
        q.lagged = false;
        q.replaying = q.live;
        q.dropped = None;
        q.floor = 0;
        if live {
            q.epoch = None;
        }
        drop(q);
        self.release(freed);
    }

    /// The oldest queued frame of `stream`, its bytes returned to the budget.
    pub fn pop(&self, stream: &Stream) -> Option<Queued> {
        let mut q = stream.lock();
        let f = q.frames.pop_front()?;
        q.bytes = q.bytes.saturating_sub(f.text.len());
        drop(q);
        self.release(f.text.len());
        Some(f)
    }

    /// Tells every stream the relay's epoch changed: its queue is emptied, it stops being live
    /// and `epoch {epoch}` waits in its epoch slot (written before the replay, which it ends);
    /// the client runs spec §5's new-epoch handling and resumes. A stream whose registration
    /// was dropped meanwhile is skipped.
    pub fn announce_epoch(&self, epoch: &str) {
        let all: Vec<Arc<Stream>> = self.map().values().cloned().collect();
        let text = frame_text(&ServerFrame::Epoch {
            epoch: epoch.to_owned(),
        });
        for s in all {
            let mut q = s.lock();
            if q.closed {
                continue;
            }
            let freed = q.bytes;
            q.frames.clear();
            q.bytes = 0;
            q.live = false;
            q.lagged = false;
            q.replaying = false;
            q.dropped = None;
            q.floor = 0;
            q.epoch = Some(text.clone());
            drop(q);
            self.release(freed);
            s.wake.notify_one();
        }
    }

    /// The announced `epoch` frame of `stream`, if one waits.
    pub fn take_epoch(&self, stream: &Stream) -> Option<String> {
        stream.lock().epoch.take()
    }

    /// Asks `key`'s stream to close with `code`; true when there was one.
    pub fn close_key(&self, key: &str, code: u16) -> bool {
        let s = self.map().get(key).cloned();
        s.map(|s| s.request_close(code)).is_some()
    }

    /// Asks every stream `matches` selects to close with `code`; returns how many.
    pub fn close_where(&self, code: u16, matches: impl Fn(&Stream) -> bool) -> usize {
        let chosen: Vec<Arc<Stream>> = self
            .map()
            .values()
            .filter(|s| matches(s))
            .cloned()
            .collect();
        for s in &chosen {
            s.request_close(code);
        }
        chosen.len()
    }

    /// Asks every stream to close with `code`.
    pub fn close_all(&self, code: u16) -> usize {
        self.close_where(code, |_| true)
    }

    /// Shutdown: every open stream, and any registered from now on, closes with 1001
    /// (`going away`).
    pub fn shut_down(&self) -> usize {
        self.closing.store(true, Ordering::Release);
        self.close_all(agentmbx_protocol::stream::close::GOING_AWAY)
    }

    /// Counts a close by its code (admin stats).
    pub fn count_close(&self, code: u16) {
        let mut closes = self
            .counters
            .closes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *closes.entry(code).or_default() += 1;
    }

    /// The ping period and pong timeout of streams opened from now on: the contract's 25,000
    /// and 60,000 ms unless [`Hub::set_timers`] changed them.
    pub fn timers(&self) -> (std::time::Duration, std::time::Duration) {
        (
            std::time::Duration::from_millis(self.ping_ms.load(Ordering::Relaxed)),
            std::time::Duration::from_millis(self.pong_ms.load(Ordering::Relaxed)),
        )
    }

    /// Sets the ping period and pong timeout (ms, at least 1) of streams opened from now on.
    /// Only tests change them (the contract fixes 25 s and 60 s).
    pub fn set_timers(&self, ping_ms: u64, pong_ms: u64) {
        self.ping_ms.store(ping_ms.max(1), Ordering::Relaxed);
        self.pong_ms.store(pong_ms.max(1), Ordering::Relaxed);
    }

    /// Streams registered now (one per host key).
    pub fn open(&self) -> usize {
        self.map().len()
    }

    /// Connection loops still running.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    /// Bytes queued across all streams (the budget in use).
    pub fn budget_used(&self) -> usize {
        self.budget_used.load(Ordering::Acquire)
    }

    /// Resolves once no connection loop runs.
    pub async fn all_ended(&self) {
        loop {
            let ended = self.ended.notified();
            if self.running() == 0 {
                return;
            }
            ended.await;
        }
    }

    /// Admin stats `streams`: `{open, running, opened, lagged, dropped_frames, queued_bytes,
    /// budget_bytes, closes: {<code>: n}}`.
    pub fn stats(&self) -> serde_json::Value {
        let closes: serde_json::Map<String, serde_json::Value> = self
            .counters
            .closes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(code, n)| (code.to_string(), serde_json::Value::from(*n)))
            .collect();
        serde_json::json!({
            "open": self.open(),
            "running": self.running(),
            "opened": self.counters.opened.load(Ordering::Relaxed),
            "lagged": self.counters.lagged.load(Ordering::Relaxed),
            "dropped_frames": self.counters.dropped_frames.load(Ordering::Relaxed),
            "queued_bytes": self.budget_used(),
            "budget_bytes": self.budget_cap,
            "closes": closes,
        })
    }
}

/// A registered stream; dropping it unregisters the stream (unless a newer one replaced it)
/// and returns its queued bytes to the budget.
#[derive(Debug)]
pub struct Registration {
    hub: Arc<Hub>,
    /// The stream.
    pub stream: Arc<Stream>,
}

impl Registration {
    /// The hub the stream is registered in.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        {
            let mut map = self.hub.map();
            if map
                .get(&self.stream.key)
                .is_some_and(|s| s.id == self.stream.id)
            {
                map.remove(&self.stream.key);
            }
        }
        self.stream.lock().closed = true;
        self.hub.reset(&self.stream, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(seq: i64, len: usize) -> LiveItem {
        LiveItem {
            seq,
            prev_seq: seq - 1,
            kind: "envelope".into(),
            item_id: format!("i{seq}"),
            sender_pubkey: "s".into(),
            wire: bytes::Bytes::from(vec![b'x'; len]),
        }
    }

    #[test]
    fn a_full_queue_drops_live_frames_and_says_lagged_once() {
        let hub = Arc::new(Hub::default());
        let reg = hub.register("K", "fp", None);
        hub.publish("K", &item(1, 10));
        assert!(!reg.stream.has_frames(), "not live before resume");
        hub.reset(&reg.stream, true);
        hub.end_replay(&reg.stream, 0);
        for seq in 1..=100 {
            hub.publish("K", &item(seq, 10_000));
        }
        let mut delivered = 0;
        let mut lagged = Vec::new();
        while let Some(f) = hub.pop(&reg.stream) {
            if f.marker {
                lagged.push(f.seq);
            } else {
                delivered += 1;
            }
        }
        assert!(delivered > 0 && delivered < 100, "{delivered}");
        assert_eq!(lagged, vec![i64::from(delivered) + 1]);
        assert_eq!(hub.budget_used(), 0);
        drop(reg);
        assert_eq!(hub.open(), 0);
    }

    /// Pops every queued frame: `(seq, marker)`.
    fn drain(hub: &Hub, stream: &Stream) -> Vec<(i64, bool)> {
        std::iter::from_fn(|| hub.pop(stream).map(|f| (f.seq, f.marker))).collect()
    }

    #[test]
    fn during_a_replay_an_overflow_waits_for_its_end_and_the_replay_may_cover_it() {
        let hub = Arc::new(Hub::default());
        let reg = hub.register("K", "fp", None);
        hub.reset(&reg.stream, true);
        for seq in 1..=100 {
            hub.publish("K", &item(seq, 10_000));
        }
        let queued = drain(&hub, &reg.stream);
        let fitted = i64::try_from(queued.len()).expect("len");
        assert!(fitted > 0 && fitted < 100, "{fitted}");
        assert!(
            queued.iter().all(|&(_, marker)| !marker),
            "no marker yet: {queued:?}"
        );
        assert_eq!(hub.stats()["lagged"], 0);
        // The replay sent up to 100: every dropped seq was carried, nothing to tell.
        hub.end_replay(&reg.stream, 100);
        assert!(drain(&hub, &reg.stream).is_empty());
        assert_eq!(hub.stats()["lagged"], 0);
        // Live again after it.
        hub.publish("K", &item(101, 10));
        assert_eq!(drain(&hub, &reg.stream), vec![(101, false)]);
        assert_eq!(hub.budget_used(), 0);
    }

    #[test]
    fn a_replay_that_stops_below_the_dropped_seqs_ends_in_lagged_after_the_queue() {
        let hub = Arc::new(Hub::default());
        let reg = hub.register("K", "fp", None);
        hub.reset(&reg.stream, true);
        for seq in 1..=100 {
            hub.publish("K", &item(seq, 10_000));
        }
        // A drop never leaves a hole: a small frame after the first drop is dropped too.
        hub.publish("K", &item(101, 10));
        // The replay sent up to 3: those are taken out of the queue, the rest stays in order.
        hub.end_replay(&reg.stream, 3);
        let frames = drain(&hub, &reg.stream);
        let (marker, live) = frames.split_last().expect("frames");
        let fitted = i64::try_from(live.len()).expect("len") + 3;
        assert_eq!(live, (4..=fitted).map(|s| (s, false)).collect::<Vec<_>>());
        assert_eq!(*marker, (fitted + 1, true), "lagged from the first drop");
        assert_eq!(hub.stats()["lagged"], 1);
        // Lagged: nothing more until the next resume.
        hub.publish("K", &item(102, 10));
        assert!(drain(&hub, &reg.stream).is_empty());
        // A replay that ended past the first drop: lagged from the seq after it.
        hub.reset(&reg.stream, true);
        for seq in 200..=300 {
            hub.publish("K", &item(seq, 10_000));
        }
        hub.end_replay(&reg.stream, 290);
        assert_eq!(drain(&hub, &reg.stream).last(), Some(&(291, true)));
        assert_eq!(hub.budget_used(), 0);
    }

    #[test]
    fn a_chunk_read_past_every_drop_reopens_the_queue_during_the_replay() {
        let hub = Arc::new(Hub::default());
        let reg = hub.register("K", "fp", None);
        hub.reset(&reg.stream, true);
        for seq in 1..=100 {
            hub.publish("K", &item(seq, 10_000));
        }
        assert!(hub.budget_used() > 0);
        // A chunk up to 60: the queued frames (about 19 fit, all below 60) are the replay's
        // and leave the queue; seqs above 60 were dropped and not read yet, so it still drops.
        hub.replay_read(&reg.stream, 60);
        assert_eq!(hub.budget_used(), 0);
        hub.publish("K", &item(101, 10));
        assert!(!reg.stream.has_frames());
        // A chunk up to 101 (the replay read every dropped seq): live frames are queued again,
        // and a late publish of a seq the replay read is not.
        hub.replay_read(&reg.stream, 101);
        hub.publish("K", &item(99, 10));
        hub.publish("K", &item(102, 10));
        hub.end_replay(&reg.stream, 101);
        assert_eq!(drain(&hub, &reg.stream), vec![(102, false)]);
        assert_eq!(hub.stats()["lagged"], 0);
        assert_eq!(hub.budget_used(), 0);
    }

    #[test]
    fn an_item_too_large_for_the_queue_during_a_replay_waits_for_its_end() {
        let hub = Arc::new(Hub::default());
        let reg = hub.register("K", "fp", None);
        hub.reset(&reg.stream, true);
        hub.publish("K", &item(7, STREAM_QUEUE_BYTES));
        assert!(!reg.stream.has_frames());
        // The replay stopped at 6 (e.g. its page bound): 7 is told.
        hub.end_replay(&reg.stream, 6);
        assert_eq!(drain(&hub, &reg.stream), vec![(7, true)]);
        // A replay that carried it: nothing is told.
        hub.reset(&reg.stream, true);
        hub.publish("K", &item(8, STREAM_QUEUE_BYTES));
        hub.end_replay(&reg.stream, 8);
        assert!(drain(&hub, &reg.stream).is_empty());
        assert_eq!(hub.budget_used(), 0);
    }

    #[test]
    fn an_item_larger_than_the_queue_is_lagged_at_once() {
        let hub = Arc::new(Hub::default());
        let reg = hub.register("K", "fp", None);
        hub.reset(&reg.stream, true);
        hub.end_replay(&reg.stream, 0);
        hub.publish("K", &item(7, STREAM_QUEUE_BYTES));
        let f = hub.pop(&reg.stream).expect("a frame");
        assert!(f.marker);
        assert_eq!(f.text, r#"{"type":"lagged","from_seq":7}"#);
        assert!(hub.pop(&reg.stream).is_none());
        assert_eq!(hub.budget_used(), 0);
    }

    #[test]
    fn the_relay_budget_bounds_all_queues_together() {
        let hub = Arc::new(Hub::with_budget(50_000));
        let a = hub.register("A", "fa", None);
        let b = hub.register("B", "fb", None);
        for reg in [&a, &b] {
            hub.reset(&reg.stream, true);
            hub.end_replay(&reg.stream, 0);
        }
        for seq in 1..=10 {
            hub.publish("A", &item(seq, 8_000));
            hub.publish("B", &item(seq, 8_000));
        }
        assert!(hub.budget_used() <= 50_000 + 200, "{}", hub.budget_used());
        drop(a);
        drop(b);
        assert_eq!(hub.budget_used(), 0);
    }

    #[test]
    fn an_epoch_announcement_empties_the_queue_and_waits_in_its_slot() {
        let hub = Arc::new(Hub::default());
        let reg = hub.register("K", "fp", None);
        hub.reset(&reg.stream, true);
        hub.publish("K", &item(1, 1_000));
        hub.publish("K", &item(2, 1_000));
        assert!(hub.budget_used() > 0);
        hub.announce_epoch("e2");
        assert_eq!(hub.budget_used(), 0, "the dropped frames' bytes returned");
        assert!(!reg.stream.has_frames());
        assert!(reg.stream.has_epoch());
        assert_eq!(
            hub.take_epoch(&reg.stream).as_deref(),
            Some(r#"{"type":"epoch","epoch":"e2"}"#)
        );
        assert!(hub.take_epoch(&reg.stream).is_none(), "sent once");
        hub.publish("K", &item(3, 10));
        assert!(!reg.stream.has_frames(), "not live until the next resume");
        drop(reg);
        assert_eq!(hub.budget_used(), 0);
    }

    #[test]
    fn a_second_stream_for_a_key_replaces_the_first() {
        let hub = Arc::new(Hub::default());
        let first = hub.register("K", "fp", None);
        let second = hub.register("K", "fp", None);
        assert_eq!(
            first.stream.close_requested(),
            Some(agentmbx_protocol::stream::close::REPLACED)
        );
        assert_eq!(second.stream.close_requested(), None);
        drop(first);
        assert_eq!(hub.open(), 1, "the newer one stays registered");
        drop(second);
        assert_eq!(hub.open(), 0);
    }
}
