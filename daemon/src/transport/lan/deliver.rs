//! LAN delivery of the outbox and of the receipts this host owes (`wire.md` §4 "Outbox client",
//! "Receipts client"; spec §9, §10).
//!
//! One pass: the due rows the LAN takes ([`outbox::due_for_lan`], oldest first, at most
//! [`MAX_ROWS_PER_PASS`]) grouped per host; each row sealed to the peer's enc key once and
//! persisted before its first attempt ([`crate::node::outbound::seal_once`]: the same bytes
//! serve the LAN and the relay); `POST /v2/envelopes` in batches bounded by count
//! ([`MAX_BATCH`]) and by bytes ([`MAX_BATCH_BYTES`], under the peer's 4 MiB body cap,
//! Decision 8). Per result, in one transaction per batch
//! ([`crate::node::outbound::settle_lan_batch`]): `accepted`/`duplicate` → `delivered` via
//! `lan`; `rejected:<why>` → `rejected` plus a local alert to the sender. A failed call
//! (network, HTTP, bad answer) is a LAN failure for every row of the host in this pass
//! ([`outbox::fail_lan`]): backoff, and after two of them the relay takes the row
//! ([`crate::transport::select`]); a row no relay ever accepted gives up after 72 h
//! (`undelivered`, with an alert). A 429 (the peer's per-peer rate limit) is no failure: the
//! same batch goes again after a short pause, in the same pass ([`RATE_LIMIT_PAUSE`]); only a
//! peer still refusing after [`RATE_LIMIT_RETRIES`] pauses makes it one.
//!
//! Every pass ends with the 72 h sweep ([`outbox::give_up_stale`]): a pending row no relay ever
//! accepted that is more than 72 h old ends `undelivered` with its alert, whichever transport
//! was trying it, or none (a peer with no LAN address and no relay), so no mail waits forever
//! unnoticed. Then the deadline rule of rows a relay accepted ([`crate::node::settle`]: no
//! delivery receipt by the deadline → `unconfirmed`, with an alert). The loop passes at least
//! every [`IDLE_WAIT_MS`].
//!
//! Then the due receipts the LAN takes, at most [`RECEIPT_BATCH`] per host in one
//! `POST /v1/receipts` (a 429 waited out the same way); a length mismatch or any error is a
//! failure of all of them ([`crate::node::outbound::fail_lan_receipts`]), an answer settles
//! them all ([`crate::node::outbound::settle_lan_receipts`]). This module opens no store
//! transaction itself: every write after an attempt is a named step of
//! [`crate::node::outbound`].
//!
//! Per-peer LAN memory (spec §10, `crate::mailbox::lan_memory`): while a relay route exists for
//! the peer, a failure that shows the address does not answer (no connection: refused, no
//! route, connect timeout; or no connection and answer within [`LAN_RACE`], per attempt)
//! marks the peer in the transaction that records the failure, and its rows and receipts go to
//! the relay at once. A raced call that did not answer in time goes on detached; its peer is
//! skipped while it is open ([`InFlight`]) and its verdicts are applied late
//! ([`crate::node::outbound::settle_late_lan_batch`]). The loop's pass
//! ([`LanDelivery::pass_detached`]) starts each host's work as its own task, counted in flight
//! for its host, and never waits for it, so one peer's slow answer never holds the attempts to
//! the others. Each pass starts the due probes of marked addresses
//! ([`LanDelivery::start_probes`]), detached as well.
//!
//! The loop ([`run`]) wakes on its `Notify` (new mail, a peer that is back, a detached call or
//! probe that ended) or at the earliest `next_at` of what it takes (peers with a call open left
//! out, never sooner than [`INFLIGHT_FLOOR_MS`] while one is), never on a fast fixed tick. It
//! never decides by itself what the relay does, and never trusts a delivery answer for more than the peer's word (0.5.x F5).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::EncPublicKey;

use super::client::{LanClient, LanError};
use crate::liveness;
use crate::mailbox::lan_memory::{self, DownReason};
use crate::mailbox::peers::Peer;
use crate::mailbox::receipts::{self, RECEIPT_BATCH};
use crate::mailbox::{outbox, peers, Mailbox, MailboxError};
use crate::node::outbound;

/// Outbox rows taken per pass (`wire.md` §4: ≤200).
pub const MAX_ROWS_PER_PASS: usize = 200;
/// Envelopes per `POST /v2/envelopes` (the peer's limit, `wire.md` §4).
pub const MAX_BATCH: usize = 200;
/// Bytes of the request body we stay under: the peer's 4 MiB cap minus room for the JSON
/// around the wires (Decision 8: a backlog never makes a body the peer refuses forever).
pub const MAX_BATCH_BYTES: usize = super::server::MAX_BODY - 1024;
/// Receipts taken per pass over all hosts (then at most [`RECEIPT_BATCH`] per host).
pub const MAX_RECEIPTS_PER_PASS: usize = 5 * RECEIPT_BATCH;
/// Longest sleep when nothing is due (ms): a row whose peer only gains an address later is
/// looked at within this time even without a wake.
pub const IDLE_WAIT_MS: u64 = 60_000;
/// First pause before a batch the peer refused with 429 goes again (its per-peer rate limit,
/// `wire.md` §4: 600 signed requests a minute, one more every 100 ms); doubled per refusal in
/// a row.
pub const RATE_LIMIT_PAUSE: Duration = Duration::from_millis(100);
/// Refusals (429) in a row waited out in one pass (pauses of 0.1 + 0.2 + 0.4 + 0.8 s); one
/// more is a failed attempt like any other (backoff).
pub const RATE_LIMIT_RETRIES: u32 = 4;
/// Longest pause after a failed pass (ms).
pub const MAX_RETRY_DELAY_MS: u64 = 10_000;
/// The loop's liveness bound ([`crate::liveness`]): 60 s. [`run`] stamps at each pass,
/// before each call to a peer and while it waits (every 10 s), so between two stamps there is
/// at most one call ([`super::client::REQUEST_TIMEOUT`], 15 s, connect included) and the store
/// work around it (due rows, sealing up to [`MAX_ROWS_PER_PASS`] rows, one transaction per
/// batch, the 72 h sweep and the deadline rule, each waiting at most SQLite's 5 s busy
/// timeout); twice the call's timeout plus 30 s for the store, so a slow peer or a busy disk
/// never costs a restart while a loop stuck for a minute is reported.
pub const LIVENESS_MAX_GAP: Duration =
    Duration::from_secs(2 * super::client::REQUEST_TIMEOUT.as_secs() + 30);

/// The LAN race (spec §10 "unreachable"; issue 22 part 2): while a relay route exists, a LAN
/// attempt that has not connected and had its answer (the response head) within this time
/// marks the peer's address as not answering, and its rows go to the relay at once; the call
/// itself goes on detached and may still complete (the receiver dedups by envelope id). Covers
/// one attempt's connect and wait for the answer, plus [`UPLOAD_ALLOWANCE_BYTES_PER_S`] for the
/// body, never the pauses after a 429. Without a relay there is no race (the client's own
/// timeouts stand), the enc-key fetch included.
pub const LAN_RACE: Duration = Duration::from_secs(2);
/// Body bytes per second the LAN race allows on top of [`LAN_RACE`] (1 MiB/s), so a large
/// batch to a slow but alive peer is not taken for a hang.
pub const UPLOAD_ALLOWANCE_BYTES_PER_S: u64 = 1024 * 1024;
/// Shortest sleep of the loop while LAN calls are still open (ms), so it never spins.
pub const INFLIGHT_FLOOR_MS: i64 = 50;

/// The text of a LAN attempt the race gave up on ([`LAN_RACE`]): no connection, or no answer
/// (response head), within `race`.
pub fn race_lost(race: Duration) -> LanError {
    LanError::NoConnection(format!(
        "no answer within {} ms (LAN race)",
        race.as_millis()
    ))
}

/// Why a failed LAN call says the address itself does not answer (spec §10 "unreachable"),
/// from its error: only a failure to connect ([`LanError::NoConnection`]: refused, no route,
/// connect timeout) or the LAN race ([`race_lost`]). `None` for everything after a connection
/// was made (a reset, an answer that broke off, a stale keep-alive connection closed, a status,
/// a bad answer): those count toward the two-failure rule instead.
pub fn down_reason(e: &LanError) -> Option<DownReason> {
    match e {
        LanError::NoConnection(t) if t.contains("refused") => Some(DownReason::Refused),
        LanError::NoConnection(t) if t.contains("timed out") || t.contains("LAN race") => {
            Some(DownReason::Timeout)
        }
        LanError::NoConnection(_) => Some(DownReason::Unreachable),
        _ => None,
    }
}

/// The race window for a request body of `bytes` ([`LAN_RACE`] plus the upload allowance).
pub fn race_window(race: Duration, bytes: usize) -> Duration {
    race + Duration::from_millis((bytes as u64).saturating_mul(1000) / UPLOAD_ALLOWANCE_BYTES_PER_S)
}

/// LAN calls still open, counted per peer (several detached calls can be open at once).
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<Mutex<HashMap<String, usize>>>);

impl InFlight {
    /// Counts one more open call to `host` until the returned guard is dropped; the drop
    /// raises `wake` (the loop looks again).
    fn enter(&self, host: &str, wake: Arc<tokio::sync::Notify>) -> InFlightGuard {
        self.count_in(host);
        InFlightGuard {
            map: self.clone(),
            host: host.to_string(),
            wake,
        }
    }

    /// The counts; a panic elsewhere while holding the lock leaves them consistent (each
    /// change is one map operation), so a poisoned lock is taken as it is.
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn count_in(&self, host: &str) {
        *self.map().entry(host.to_string()).or_default() += 1;
    }

    /// The peers with a call open now.
    pub fn hosts(&self) -> Vec<String> {
        self.map().keys().cloned().collect()
    }

    /// Open calls to `host`.
    pub fn count(&self, host: &str) -> usize {
        self.map().get(host).copied().unwrap_or(0)
    }
}

struct InFlightGuard {
    map: InFlight,
    host: String,
    wake: Arc<tokio::sync::Notify>,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        {
            let mut m = self.map.map();
            if let Some(n) = m.get_mut(&self.host) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    m.remove(&self.host);
                }
            }
        }
        self.wake.notify_one();
    }
}

/// What a raced LAN call came to.
enum Raced<T> {
    /// It answered (or failed) within the race, or no race applied.
    Answer(Result<T, LanError>),
    /// No answer within the race: the call goes on detached.
    Detached,
}

/// The body size of `{"envelopes":[w1,…]}` for wires of these sizes (bytes).
pub fn body_bytes(sizes: &[usize]) -> usize {
    sizes.iter().sum::<usize>() + sizes.len().saturating_sub(1) + r#"{"envelopes":[]}"#.len()
}

/// Splits wires of these sizes, in order, into consecutive batches of at most `max_count`
/// wires whose request body ([`body_bytes`]) stays within `max_bytes`; a wire that alone is
/// over the budget travels alone. Returns index ranges.
pub fn batches(sizes: &[usize], max_count: usize, max_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let mut end = start + 1;
        while end < sizes.len()
            && end - start < max_count
            && body_bytes(&sizes[start..=end]) <= max_bytes
        {
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out
}

/// Counts of one pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassCounts {
    /// Rows the peer accepted (or already had).
    pub delivered: usize,
    /// Rows the peer refused.
    pub rejected: usize,
    /// Rows that failed this pass (kept for a retry, or given up after 72 h).
    pub failed: usize,
    /// Receipts the peer took.
    pub receipts_sent: usize,
    /// Rows the 72 h sweep ended (`undelivered`, with an alert).
    pub gave_up: usize,
}

impl PassCounts {
    fn add(&mut self, o: PassCounts) {
        self.delivered += o.delivered;
        self.rejected += o.rejected;
        self.failed += o.failed;
        self.receipts_sent += o.receipts_sent;
        self.gave_up += o.gave_up;
    }
}

/// What the LAN delivery loop needs.
#[derive(Debug, Clone)]
pub struct LanDelivery {
    /// Signed calls to peers (carries this host's identity and the clock).
    pub client: LanClient,
    /// The host store.
    pub mailbox: Mailbox,
    /// Whether a relay is configured: without one the LAN keeps every row (spec §10). Shared,
    /// so the daemon can follow a `[relay]` table added or removed while it runs (read at each
    /// pass).
    pub relay_configured: Arc<std::sync::atomic::AtomicBool>,
    /// The failpoints the loop hits (`lan:deliver-pass`): the daemon's own set; [`Self::new`]
    /// gives the process's ([`agentmbx_protocol::failpoint::Failpoints::from_env`]).
    pub failpoints: agentmbx_protocol::failpoint::Failpoints,
    /// LAN calls still open per peer: that peer's rows and receipts are skipped meanwhile.
    pub inflight: InFlight,
    /// This loop's own wake, raised when a detached call or a probe ends ([`run`] sets it to
    /// the `wake` it is given).
    pub self_wake: Arc<tokio::sync::Notify>,
    /// The relay loop's wake, raised when a peer is marked LAN down (its rows are due on the
    /// relay now). The daemon sets it; by default a `Notify` nobody waits on.
    pub relay_wake: Arc<tokio::sync::Notify>,
    /// The LAN race ([`LAN_RACE`]); a test may shorten it.
    pub race: Duration,
}

impl LanDelivery {
    /// A delivery loop's state.
    pub fn new(client: LanClient, mailbox: Mailbox, relay_configured: bool) -> Self {
        LanDelivery {
            client,
            mailbox,
            relay_configured: Arc::new(relay_configured.into()),
            failpoints: agentmbx_protocol::failpoint::Failpoints::from_env(),
            inflight: InFlight::default(),
            self_wake: Arc::new(tokio::sync::Notify::new()),
            relay_wake: Arc::new(tokio::sync::Notify::new()),
            race: LAN_RACE,
        }
    }

    fn clock(&self) -> &SharedClock {
        &self.client.clock
    }

    fn now(&self) -> i64 {
        self.clock().now_ms()
    }

    fn relay(&self) -> bool {
        self.relay_configured
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// How a failed attempt bears on the peer's LAN memory: `down` as found, a relay
    /// configured or not, the first probe jittered ([`lan_memory::probe_delay_ms`]).
    fn verdict(&self, down: Option<DownReason>, local: bool, relay: bool) -> outbound::LanVerdict {
        outbound::LanVerdict {
            down,
            relay_configured: relay,
            local,
            probe_at: self.now() + lan_memory::probe_delay_ms(0, rand::random::<f64>()),
        }
    }

    /// Whether a relay route exists for `host` now ([`lan_memory::relay_route`]: a relay
    /// configured, in use, and no `target not enrolled` recorded for the peer's key): only then
    /// is a LAN attempt raced and a failure a mark. A storage fault reads as no route (the LAN's
    /// own timeouts stand, nothing is marked).
    async fn relay_route(&self, host: &str) -> bool {
        let (relay, h) = (self.relay(), host.to_string());
        if !relay {
            return false;
        }
        match self
            .mailbox
            .run(move |c| lan_memory::relay_route(c, &h, relay))
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(peer = %host, error = %e, "cannot read the relay route");
                false
            }
        }
    }

    /// Logs a new mark and wakes the relay loop.
    fn marked(&self, host: &str, down: Option<DownReason>, error: &str) {
        let reason = down.unwrap_or(DownReason::Failed).as_str();
        tracing::warn!(event = "lan.down", peer = %host, reason, error, "the LAN address of {host} does not answer: its mail goes via the relay until the address answers again");
        self.relay_wake.notify_one();
    }

    /// One pass over due rows and due receipts, hosts in parallel, waiting for every host's
    /// work (tests and one-shot callers; the loop uses [`Self::pass_detached`]), then the due
    /// probes, the 72 h sweep ([`Self::give_up_stale`]) and the deadline rule. Errors: storage
    /// faults (network failures are recorded on the rows, not returned).
    pub async fn pass(&self) -> Result<PassCounts, MailboxError> {
        let launched = self.launch().await?;
        let mut counts = PassCounts::default();
        let mut first_error = None;
        for h in launched {
            match h.await {
                Ok(Ok(c)) => counts.add(c),
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    first_error.get_or_insert(MailboxError::Task);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        counts.gave_up += self.after_launch().await?;
        Ok(counts)
    }

    /// The loop's pass: each host's work is started detached (counted in flight for its host,
    /// its end wakes the loop) and never waited for, so no peer's attempt waits on another
    /// peer's slow answer; then the due probes, the 72 h sweep and the deadline rule. A row whose
    /// attempt is still under way when the sweep ends it at 72 h is still settled `delivered` by
    /// a later LAN accept (`outbox::delivered_lan`). Errors: storage faults of the selection
    /// and the sweep (a host's own storage fault is logged by its task).
    pub async fn pass_detached(&self) -> Result<(), MailboxError> {
        drop(self.launch().await?);
        self.after_launch().await?;
        Ok(())
    }

    /// Due probes, the 72 h sweep and the deadline rule, after a pass started its hosts' work.
    /// Returns the rows the sweep ended.
    async fn after_launch(&self) -> Result<usize, MailboxError> {
        self.start_probes().await?;
        let gave_up = self.give_up_stale().await?;
        crate::node::settle::settle_pass(&self.mailbox, self.client.ident.clone(), self.now())
            .await?;
        Ok(gave_up)
    }

    /// Selects the due rows and receipts the LAN takes (peers with a call open left out) and
    /// starts each host's work as its own task, counted in flight for its host until it ends
    /// (the end wakes the loop). Returns the tasks' handles (dropping them detaches the work).
    async fn launch(
        &self,
    ) -> Result<Vec<tokio::task::JoinHandle<Result<PassCounts, MailboxError>>>, MailboxError> {
        let now = self.now();
        let relay = self
            .relay_configured
            .load(std::sync::atomic::Ordering::Acquire);
        let busy = self.inflight.hosts();
        let ex = busy.clone();
        let (rows, due_receipts) = self
            .mailbox
            .run(move |c| {
                receipts::expire(c, now)?;
                Ok((
                    outbox::due_for_lan_except(c, now, MAX_ROWS_PER_PASS, relay, &ex)?,
                    receipts::due_for_lan_except(c, now, MAX_RECEIPTS_PER_PASS, relay, &ex)?,
                ))
            })
            .await?;
        // A call may have opened meanwhile: its host is left out too.
        let busy = self.inflight.hosts();
        let mut by_host: BTreeMap<String, Vec<outbox::Row>> = BTreeMap::new();
        for r in rows.into_iter().filter(|r| !busy.contains(&r.host)) {
            by_host.entry(r.host.clone()).or_default().push(r);
        }
        let mut receipts_by_host: BTreeMap<String, Vec<receipts::Row>> = BTreeMap::new();
        for r in due_receipts.into_iter().filter(|r| !busy.contains(&r.host)) {
            let list = receipts_by_host.entry(r.host.clone()).or_default();
            if list.len() < RECEIPT_BATCH {
                list.push(r);
            }
        }
        let mut launched = Vec::new();
        for (host, rows) in by_host {
            let this = self.clone();
            let guard = self.inflight.enter(&host, self.self_wake.clone());
            launched.push(tokio::spawn(liveness::inherit(async move {
                let _guard = guard;
                let r = this.deliver_host(&host, rows).await;
                match &r {
                    // A LAN failure moves a row toward the relay: let its loop look now.
                    Ok(c) if c.failed > 0 && this.relay() => this.relay_wake.notify_one(),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(peer = %host, error = %e, "LAN delivery failed in the mailbox");
                    }
                }
                r
            })));
        }
        for (host, rows) in receipts_by_host {
            let this = self.clone();
            let guard = self.inflight.enter(&host, self.self_wake.clone());
            launched.push(tokio::spawn(liveness::inherit(async move {
                let _guard = guard;
                let sent = rows.len();
                let r = this.flush_receipts(&host, rows).await;
                match &r {
                    // Receipts the LAN did not take move toward the relay: let its loop look.
                    Ok(c) if c.receipts_sent < sent && this.relay() => this.relay_wake.notify_one(),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(peer = %host, error = %e, "LAN receipts failed in the mailbox");
                    }
                }
                r
            })));
        }
        Ok(launched)
    }

    /// The 72 h sweep (`wire.md` §4 "Outbox client"): ends every pending row no relay ever
    /// accepted that is more than 72 h old, whichever transport was trying it or none, with an
    /// alert to its sender, in one transaction per batch of [`outbox::GIVE_UP_BATCH`] rows.
    /// Runs after the pass's attempts, so a due row gets its last attempt first. Returns how
    /// many rows it ended. Errors: storage faults.
    pub async fn give_up_stale(&self) -> Result<usize, MailboxError> {
        let mut total = 0;
        loop {
            let (ident, now) = (self.client.ident.clone(), self.now());
            let ended = self
                .mailbox
                .run(move |c| outbound::give_up_stale(c, &ident, now))
                .await?;
            for g in &ended {
                tracing::warn!(id = %g.msg_id, peer = %g.host, reason = %g.reason, "Undelivered to {}: gave up after 72 h", g.host);
            }
            total += ended.len();
            if ended.len() < outbox::GIVE_UP_BATCH {
                return Ok(total);
            }
        }
    }

    /// The earliest time (ms) anything the LAN takes is due, if any: its `next_at`, or now for
    /// a row or receipt scheduled further ahead than its backoff allows (a clock that was
    /// ahead when it was scheduled; [`outbox::max_horizon_ms`]), or a probe of a marked address.
    /// Peers with a LAN call still open are left out (their rows are skipped until it ends, and
    /// its end wakes the loop), and while any call is open the time is at least
    /// [`INFLIGHT_FLOOR_MS`] ahead, so the loop never spins.
    pub async fn next_due(&self) -> Result<Option<i64>, MailboxError> {
        let relay = self.relay();
        let now = self.now();
        let busy = self.inflight.hosts();
        let floor = if busy.is_empty() {
            i64::MIN
        } else {
            now + INFLIGHT_FLOOR_MS
        };
        self.mailbox
            .run(move |c| {
                let rows = outbox::next_due_for_lan(c, relay, now, &busy)?;
                let rec = receipts::next_due_for_lan(c, relay, now, &busy)?;
                let probe = lan_memory::all(c)?
                    .into_iter()
                    .filter(|p| {
                        p.down_since.is_some()
                            && p.addr.as_deref().is_some_and(|a| !a.is_empty())
                            && !busy.contains(&p.host)
                    })
                    .map(|p| p.probe_at.unwrap_or(now))
                    .min();
                Ok(rows
                    .into_iter()
                    .chain(rec)
                    .chain(probe)
                    .min()
                    .map(|t| t.max(floor)))
            })
            .await
    }

    /// Starts a probe of each marked address that is due ([`lan_memory::due_probes`]) and has
    /// no call open, detached: a signed `GET /v1/enc-key` whose ad is signed by the peer's
    /// pinned host key, within the LAN race ([`LanDelivery::race`]). Only that shows the address
    /// answers again: the mark clears ([`lan_memory::clear`]) and the
    /// peer's queued rows are due over the LAN now; no answer backs the next probe off
    /// ([`lan_memory::probe_failed`], 5 s doubling to 5 min, jittered). Errors: storage faults.
    pub async fn start_probes(&self) -> Result<(), MailboxError> {
        let now = self.now();
        let due = self
            .mailbox
            .run(move |c| lan_memory::due_probes(c, now))
            .await?;
        for (host, addr) in due {
            if self.inflight.count(&host) > 0 {
                continue;
            }
            let guard = self.inflight.enter(&host, self.self_wake.clone());
            let this = self.clone();
            tokio::spawn(async move {
                let _guard = guard;
                this.probe(&host, &addr).await;
            });
        }
        Ok(())
    }

    /// One probe of `host`'s marked address `addr` ([`Self::start_probes`]): its enc key
    /// ([`LanClient::get_enc_key`](super::client::LanClient::get_enc_key), the ad verified
    /// against the peer's pinned host key) within the same [`LanDelivery::race`] a delivery
    /// gets. Anything else (no answer in time, a status, an unsigned or foreign answer) is a
    /// failed probe.
    async fn probe(&self, host: &str, addr: &str) {
        let h = host.to_string();
        let peer = match self.mailbox.run(move |c| peers::by_name(c, &h)).await {
            Ok(Some(p)) => p,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(peer = %host, error = %e, "could not read the peer for a LAN probe");
                return;
            }
        };
        let answer = tokio::time::timeout(self.race, self.client.get_enc_key(addr, &peer)).await;
        let answer = match answer {
            Ok(Ok(_)) => Ok(Ok((200u16, ()))),
            Ok(Err(e)) => Ok(Err(e)),
            Err(e) => Err(e),
        };
        let now = self.now();
        let h = host.to_string();
        match answer {
            Ok(Ok((status, _))) => {
                let cleared = self
                    .mailbox
                    .run(move |c| {
                        let tx = c.transaction()?;
                        let cleared = lan_memory::clear(&tx, &h, now)?;
                        tx.commit()?;
                        Ok(cleared)
                    })
                    .await;
                match cleared {
                    Ok(true) => {
                        tracing::info!(event = "lan.up", peer = %host, addr, status, "the LAN address of {host} answers again: its mail goes over the LAN");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(peer = %host, error = %e, "could not clear the LAN mark")
                    }
                }
            }
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {} ms", self.race.as_millis()),
                };
                let jitter = rand::random::<f64>();
                let r = self
                    .mailbox
                    .run(move |c| lan_memory::probe_failed(c, &h, now, jitter))
                    .await;
                match r {
                    Ok(Some(n)) => {
                        tracing::debug!(event = "lan.probe", peer = %host, addr, failed = n, error = %error, "the LAN address still does not answer");
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(peer = %host, error = %e, "could not record a LAN probe")
                    }
                }
            }
        }
    }

    /// The peer's enc key: pinned, else fetched from its LAN server (a v1 ad signed by its
    /// pinned host key) and recorded. With a relay configured the fetch is raced
    /// ([`LAN_RACE`]): no answer within it is a timeout of the address. Errors: the text,
    /// whether the address did not answer ([`down_reason`]), and whether the failure is this
    /// host's own (storage, a newer ad already pinned) rather than the peer's.
    async fn enc_key(
        &self,
        peer: &Peer,
        addr: &str,
    ) -> Result<EncPublicKey, (String, Option<DownReason>, bool)> {
        if let Some(k) = peer.enc_pub.as_deref() {
            if let Ok(k) = EncPublicKey::from_b64(k) {
                return Ok(k);
            }
        }
        liveness::progress();
        let fetch = self.client.get_enc_key(addr, peer);
        let fetched = if self.relay_route(&peer.host).await {
            match tokio::time::timeout(self.race, fetch).await {
                Ok(r) => r,
                Err(_) => Err(race_lost(self.race)),
            }
        } else {
            fetch.await
        };
        let enc = fetched.map_err(|e| {
            let down = down_reason(&e);
            (format!("no enc key for {}: {e}", peer.host), down, false)
        })?;
        let (h, e, now) = (peer.host.clone(), enc.clone(), self.now());
        let ok = self
            .mailbox
            .run(move |c| peers::set_enc_key(c, &h, &e, now))
            .await
            .map_err(|e| (e.to_string(), None, true))?;
        if !ok {
            return Err((
                format!(
                    "no enc key for {}: an enc key with a newer ad is already pinned",
                    peer.host
                ),
                None,
                true,
            ));
        }
        EncPublicKey::from_b64(&enc)
            .map_err(|_| (format!("no enc key for {}", peer.host), None, false))
    }

    /// Delivers one host's due rows (oldest first).
    async fn deliver_host(
        &self,
        host: &str,
        rows: Vec<outbox::Row>,
    ) -> Result<PassCounts, MailboxError> {
        let h = host.to_string();
        let Some(peer) = self.mailbox.run(move |c| peers::by_name(c, &h)).await? else {
            return Ok(PassCounts::default());
        };
        let Some(addr) = peer.addr.clone().filter(|a| !a.is_empty()) else {
            return Ok(PassCounts::default());
        };
        // Seal what was never sealed, once, before any attempt.
        let mut rows = rows;
        if rows.iter().any(|r| r.wire.is_none()) {
            match self.enc_key(&peer, &addr).await {
                Ok(key) => {
                    let ident = self.client.ident.clone();
                    let unsealed: Vec<outbox::Row> =
                        rows.iter().filter(|r| r.wire.is_none()).cloned().collect();
                    let sealed = self
                        .mailbox
                        .run(move |c| {
                            let mut out = Vec::new();
                            for r in &unsealed {
                                let w = match outbound::seal_once(
                                    c,
                                    r,
                                    &key,
                                    ident.host.as_str(),
                                    &ident.host_key,
                                ) {
                                    Ok(w) => Ok(w),
                                    Err(MailboxError::Invalid(e)) => Err(e),
                                    Err(e) => return Err(e),
                                };
                                out.push((r.msg_id.clone(), w));
                            }
                            Ok(out)
                        })
                        .await?;
                    let mut broken = Vec::new();
                    for (id, w) in sealed {
                        match w {
                            Ok(w) => {
                                if let Some(r) = rows.iter_mut().find(|r| r.msg_id == id) {
                                    r.wire = Some(w);
                                }
                            }
                            Err(e) => broken.push((id, e)),
                        }
                    }
                    let mut counts = PassCounts::default();
                    for (id, e) in broken {
                        let row: Vec<outbox::Row> =
                            rows.iter().filter(|r| r.msg_id == id).cloned().collect();
                        counts.add(self.fail_rows(host, &row, &e, None, true).await?);
                        rows.retain(|r| r.msg_id != id);
                    }
                    let rest = self.send_sealed(host, &addr, rows).await?;
                    counts.add(rest);
                    return Ok(counts);
                }
                Err((e, down, local)) => {
                    tracing::warn!(peer = %host, error = %e, "cannot seal for the peer yet");
                    return self.fail_rows(host, &rows, &e, down, local).await;
                }
            }
        }
        self.send_sealed(host, &addr, rows).await
    }

    /// Posts sealed rows in batches; the first failed batch fails it and every later row of
    /// the host in this pass, except after a lost race: then only the batch sent counts an
    /// attempt (the mark hands the later ones to the relay).
    async fn send_sealed(
        &self,
        host: &str,
        addr: &str,
        rows: Vec<outbox::Row>,
    ) -> Result<PassCounts, MailboxError> {
        let sizes: Vec<usize> = rows
            .iter()
            .map(|r| r.wire.as_ref().map_or(0, Vec::len))
            .collect();
        let mut counts = PassCounts::default();
        for range in batches(&sizes, MAX_BATCH, MAX_BATCH_BYTES) {
            let batch = &rows[range.clone()];
            let wires: Vec<Vec<u8>> = batch
                .iter()
                .map(|r| r.wire.clone().unwrap_or_default())
                .collect();
            let raced = self.post_raced(host, addr, batch, wires).await;
            let answer = match raced {
                Raced::Answer(a) => a,
                Raced::Detached => {
                    let e = format!(
                        "no answer within {} ms: sent via the relay",
                        self.race.as_millis()
                    );
                    tracing::warn!(peer = %host, addr, error = %e, "LAN delivery hangs");
                    // Only the batch that was sent counts a LAN attempt; the later ones were
                    // never sent, and the mark switches them to the relay with the rest.
                    counts.add(
                        self.fail_rows(host, batch, &e, Some(DownReason::Timeout), false)
                            .await?,
                    );
                    break;
                }
            };
            match answer {
                Ok(results) => {
                    let (ident, h, now) = (self.client.ident.clone(), host.to_string(), self.now());
                    let verdicts: Vec<(String, String)> = batch
                        .iter()
                        .map(|row| {
                            let result = results
                                .iter()
                                .find(|r| r.id == row.msg_id)
                                .map_or(super::client::MISSING_RESULT, |r| r.result.as_str());
                            (row.msg_id.clone(), result.to_string())
                        })
                        .collect();
                    let c = self
                        .mailbox
                        .run(move |c| outbound::settle_lan_batch(c, &ident, &h, &verdicts, now))
                        .await?;
                    if c.delivered > 0 {
                        tracing::info!(peer = %host, delivered = c.delivered, "delivered over the LAN");
                    }
                    if c.rejected > 0 {
                        tracing::warn!(peer = %host, rejected = c.rejected, "the peer refused mail");
                    }
                    counts.add(PassCounts {
                        delivered: c.delivered,
                        rejected: c.rejected,
                        ..PassCounts::default()
                    });
                }
                Err(e) => {
                    tracing::warn!(peer = %host, addr, error = %e, "LAN delivery failed");
                    let rest = &rows[range.start..];
                    counts.add(
                        self.fail_rows(host, rest, &e.to_string(), down_reason(&e), false)
                            .await?,
                    );
                    break;
                }
            }
        }
        Ok(counts)
    }

    /// `POST /v2/envelopes` of `wires` (the rows `batch`) to `host` at `addr`, paced through
    /// 429s as [`paced`] does. With a relay configured each attempt is raced on its own
    /// ([`race_window`]; the pauses after a 429 are not part of it): an attempt with no answer
    /// in time is left running detached (counted in [`LanDelivery::inflight`]); when it ends,
    /// its verdicts are applied late ([`outbound::settle_late_lan_batch`]: never undoing a
    /// relay's settlement).
    async fn post_raced(
        &self,
        host: &str,
        addr: &str,
        batch: &[outbox::Row],
        wires: Vec<Vec<u8>>,
    ) -> Raced<Vec<super::client::EnvelopeResult>> {
        if !self.relay_route(host).await {
            return Raced::Answer(paced(host, || self.client.post_envelopes(addr, &wires)).await);
        }
        let window = race_window(
            self.race,
            body_bytes(&wires.iter().map(Vec::len).collect::<Vec<_>>()),
        );
        let wires = Arc::new(wires);
        let mut pause = RATE_LIMIT_PAUSE;
        let mut refusals = 0;
        loop {
            liveness::progress();
            let (this, a, w) = (self.clone(), addr.to_string(), wires.clone());
            let mut call = tokio::spawn(async move { this.client.post_envelopes(&a, &w).await });
            let answer = match tokio::time::timeout(window, &mut call).await {
                Ok(joined) => joined.unwrap_or_else(|e| {
                    Err(LanError::Unreachable(format!(
                        "LAN call ended abnormally: {e}"
                    )))
                }),
                Err(_) => {
                    self.detach_late(host, batch, call);
                    return Raced::Detached;
                }
            };
            match answer {
                Err(LanError::Status { status: 429, .. }) if refusals < RATE_LIMIT_RETRIES => {
                    let pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX);
                    tracing::debug!(peer = %host, pause_ms, "rate-limited by the peer: sending again after a pause");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    refusals += 1;
                }
                answer => return Raced::Answer(answer),
            }
        }
    }

    /// Leaves `call` (an envelope POST for the rows `batch` that lost the race) running,
    /// counted in flight for `host`; its verdicts, if it answers, are applied late.
    fn detach_late(
        &self,
        host: &str,
        batch: &[outbox::Row],
        call: tokio::task::JoinHandle<Result<Vec<super::client::EnvelopeResult>, LanError>>,
    ) {
        let guard = self.inflight.enter(host, self.self_wake.clone());
        let this = self.clone();
        let host = host.to_string();
        let ids: Vec<String> = batch.iter().map(|r| r.msg_id.clone()).collect();
        tokio::spawn(async move {
            let _guard = guard;
            match call.await {
                Ok(Ok(results)) => this.settle_late(&host, &ids, results).await,
                Ok(Err(e)) => {
                    tracing::debug!(peer = %host, error = %e, "a detached LAN call failed")
                }
                Err(e) => {
                    tracing::debug!(peer = %host, error = %e, "a detached LAN call ended abnormally")
                }
            }
        });
    }

    /// Applies the verdicts of a detached LAN call that answered after the race
    /// ([`outbound::settle_late_lan_batch`]), logging each that disagrees with a relay's
    /// settlement.
    async fn settle_late(
        &self,
        host: &str,
        ids: &[String],
        results: Vec<super::client::EnvelopeResult>,
    ) {
        let verdicts: Vec<(String, String)> = ids
            .iter()
            .map(|id| {
                let result = results
                    .iter()
                    .find(|r| &r.id == id)
                    .map_or(super::client::MISSING_RESULT, |r| r.result.as_str());
                (id.clone(), result.to_string())
            })
            .collect();
        let (ident, h, now) = (self.client.ident.clone(), host.to_string(), self.now());
        let r = self
            .mailbox
            .run(move |c| outbound::settle_late_lan_batch(c, &ident, &h, &verdicts, now))
            .await;
        match r {
            Ok(disagreed) => {
                tracing::info!(peer = %host, rows = ids.len(), "a late LAN answer came back");
                for (id, result) in disagreed {
                    tracing::warn!(event = "lan.late_verdict", id = %id, peer = %host, result = %result, "a late LAN verdict disagrees with the relay's settlement: kept on the row, not applied");
                }
            }
            Err(e) => tracing::warn!(peer = %host, error = %e, "could not apply a late LAN answer"),
        }
    }

    /// Records a failed LAN attempt for each row in one transaction (giving up after 72 h with
    /// an alert). `down`: the address did not answer; `local`: the failure is this host's own
    /// (sealing), which never marks the peer.
    async fn fail_rows(
        &self,
        host: &str,
        rows: &[outbox::Row],
        error: &str,
        down: Option<DownReason>,
        local: bool,
    ) -> Result<PassCounts, MailboxError> {
        let ids: Vec<String> = rows.iter().map(|r| r.msg_id.clone()).collect();
        let (ident, h, e, now) = (
            self.client.ident.clone(),
            host.to_string(),
            error.to_string(),
            self.now(),
        );
        let verdict = self.verdict(down, local, self.relay_route(host).await);
        let failed = self
            .mailbox
            .run(move |c| outbound::fail_lan_rows(c, &ident, &h, &ids, &e, verdict, now))
            .await?;
        if failed.marked {
            self.marked(host, down, error);
        }
        for id in failed.gave_up {
            tracing::warn!(id = %id, peer = %host, "Undelivered to {host}: gave up after 72 h");
        }
        Ok(PassCounts {
            failed: rows.len(),
            ..PassCounts::default()
        })
    }

    /// Sends one host's due receipts in one `POST /v1/receipts`.
    async fn flush_receipts(
        &self,
        host: &str,
        rows: Vec<receipts::Row>,
    ) -> Result<PassCounts, MailboxError> {
        let h = host.to_string();
        let Some(peer) = self.mailbox.run(move |c| peers::by_name(c, &h)).await? else {
            return Ok(PassCounts::default());
        };
        let Some(addr) = peer.addr.clone().filter(|a| !a.is_empty()) else {
            return Ok(PassCounts::default());
        };
        let ident = self.client.ident.clone();
        let wires = self
            .mailbox
            .run(move |c| {
                rows.iter()
                    .map(|r| {
                        Ok((
                            r.seq,
                            outbound::receipt_wire_once(
                                c,
                                r,
                                ident.host.as_str(),
                                &ident.host_key,
                            )?,
                        ))
                    })
                    .collect::<Result<Vec<_>, MailboxError>>()
            })
            .await?;
        let seqs: Vec<i64> = wires.iter().map(|w| w.0).collect();
        let bytes: Vec<Vec<u8>> = wires.into_iter().map(|w| w.1).collect();
        let relay = self.relay_route(host).await;
        let window = race_window(self.race, bytes.iter().map(Vec::len).sum());
        // With a relay each attempt is raced on its own, never the pauses after a 429. A
        // receipt attempt that loses the race is dropped, not detached: its receipts go via
        // the relay at once and a receipt is idempotent, so nothing is lost by not waiting.
        let answer = paced(host, || async {
            let post = self.client.post_receipts(&addr, &bytes);
            if relay {
                tokio::time::timeout(window, post)
                    .await
                    .unwrap_or_else(|_| Err(race_lost(self.race)))
            } else {
                post.await
            }
        })
        .await;
        let now = self.now();
        match answer {
            Ok(results) => {
                for (seq, r) in seqs.iter().zip(&results) {
                    if r.starts_with("rejected:") {
                        tracing::warn!(event = "receipt.rejected", peer = %host, seq, result = %r, "the peer refused a delivery receipt");
                    }
                }
                let n = seqs.len();
                self.mailbox
                    .run(move |c| outbound::settle_lan_receipts(c, &seqs))
                    .await?;
                Ok(PassCounts {
                    receipts_sent: n,
                    ..PassCounts::default()
                })
            }
            Err(e) => {
                let unsupported = matches!(&e, LanError::Status { status, .. } if matches!(status, 404 | 405 | 501));
                tracing::warn!(peer = %host, error = %e, unsupported, "delivery receipts not sent");
                let err = e.to_string();
                let down = down_reason(&e);
                let verdict = self.verdict(down, false, relay);
                let h = host.to_string();
                let marked = self
                    .mailbox
                    .run(move |c| {
                        outbound::fail_lan_receipts(c, &h, &seqs, &err, unsupported, verdict, now)
                    })
                    .await?;
                if marked {
                    self.marked(host, down, &e.to_string());
                }
                Ok(PassCounts::default())
            }
        }
    }
}

/// Makes `call` (a delivery POST to `host`), again while the peer answers 429 (its per-peer
/// rate limit), after [`RATE_LIMIT_PAUSE`] doubling, at most [`RATE_LIMIT_RETRIES`] times; then
/// the last answer stands. A 429 is the peer asking to slow down, not a failure: counted as
/// one it cost the row a 5 s backoff (and, twice, a hand-over to the relay) although this
/// daemon's limit ([`super::hop::PeerLimiter`]) lets one more request through every 100 ms.
/// Resending is safe: on these routes a 429 comes from the limit, checked before the route
/// runs, so the refused request was never processed (and an envelope sent twice is answered
/// `duplicate`, never stored twice).
async fn paced<T, F, Fut>(host: &str, mut call: F) -> Result<T, LanError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, LanError>>,
{
    let mut pause = RATE_LIMIT_PAUSE;
    let mut refusals = 0;
    loop {
        liveness::progress();
        match call().await {
            Err(LanError::Status { status: 429, .. }) if refusals < RATE_LIMIT_RETRIES => {
                let pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX);
                tracing::debug!(peer = %host, pause_ms, "rate-limited by the peer: sending again after a pause");
                tokio::time::sleep(pause).await;
                pause *= 2;
                refusals += 1;
            }
            answer => return answer,
        }
    }
}

/// Runs LAN delivery until `shutdown`: a pass, then a sleep until the earliest `next_at` of
/// what the LAN takes (at most [`IDLE_WAIT_MS`]), cut short by `wake` (new mail, a peer that is
/// back). A pass that fails on storage is retried after a doubling pause (≤ 10 s).
///
/// `wake` should be this loop's own `Notify` ([`tokio::sync::Notify::notify_one`] wakes one
/// waiter only; see [`fan_out`] to feed it and the relay loop's from one source).
///
/// The loop is registered as `lan delivery` in [`liveness::global`] ([`LIVENESS_MAX_GAP`])
/// while it runs; failpoint `lan:deliver-pass` (async) is at the start of each pass.
pub async fn run(
    delivery: LanDelivery,
    wake: Arc<tokio::sync::Notify>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let beat = liveness::global().register("lan delivery", LIVENESS_MAX_GAP);
    let mut delivery = delivery;
    delivery.self_wake = wake.clone();
    beat.scope(run_loop(delivery, wake, shutdown)).await
}

async fn run_loop(
    delivery: LanDelivery,
    wake: Arc<tokio::sync::Notify>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut failures: u32 = 0;
    loop {
        if *shutdown.borrow() {
            return;
        }
        liveness::progress();
        delivery.failpoints.hang_point("lan:deliver-pass").await;
        let delay = match delivery.pass_detached().await {
            Ok(()) => {
                failures = 0;
                match delivery.next_due().await {
                    Ok(Some(t)) => Duration::from_millis(
                        (t - delivery.now()).clamp(0, IDLE_WAIT_MS as i64) as u64,
                    ),
                    Ok(None) => Duration::from_millis(IDLE_WAIT_MS),
                    Err(e) => {
                        tracing::warn!(error = %e, "LAN delivery: cannot read the next due time");
                        Duration::from_millis(MAX_RETRY_DELAY_MS)
                    }
                }
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::warn!(error = %e, "LAN delivery pass failed; retrying");
                Duration::from_millis((500u64 << failures.min(7)).min(MAX_RETRY_DELAY_MS))
            }
        };
        // Stamps the loop's liveness while it waits.
        let stop = liveness::waiting(async {
            tokio::select! {
                _ = tokio::time::sleep(delay) => false,
                _ = wake.notified() => false,
                _ = shutdown.changed() => true,
            }
        })
        .await;
        if stop {
            return;
        }
    }
}

/// Forwards every wake of `source` to each of `targets` (one `notify_one` each) until
/// `shutdown`, so one signal (a send, a peer back) reaches the LAN loop and the relay loop,
/// each of which waits on its own `Notify`.
pub fn fan_out(
    source: Arc<tokio::sync::Notify>,
    targets: Vec<Arc<tokio::sync::Notify>>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = source.notified() => {
                    for t in &targets {
                        t.notify_one();
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    })
}

#[cfg(test)]
mod tests;
