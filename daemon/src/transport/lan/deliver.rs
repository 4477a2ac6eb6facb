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
//! The loop ([`run`]) wakes on its `Notify` (new mail, a peer that is back) or at the earliest
//! `next_at` of what it takes, never on a fast fixed tick. It never decides by itself what the
//! relay does, and never trusts a delivery answer for more than the peer's word (0.5.x F5).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::EncPublicKey;

use super::client::{LanClient, LanError};
use crate::liveness;
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
    /// The relay loop's wake: notified after a pass in which a row or receipt failed on the
    /// LAN while a relay is configured (after two failures the relay takes the row,
    /// [`crate::transport::select`]), so the relay loop sees it now rather than at its next
    /// check. `None` in [`Self::new`]; the daemon sets it.
    pub relay_wake: Option<Arc<tokio::sync::Notify>>,
}

impl LanDelivery {
    /// A delivery loop's state.
    pub fn new(client: LanClient, mailbox: Mailbox, relay_configured: bool) -> Self {
        LanDelivery {
            client,
            mailbox,
            relay_configured: Arc::new(relay_configured.into()),
            failpoints: agentmbx_protocol::failpoint::Failpoints::from_env(),
            relay_wake: None,
        }
    }

    fn clock(&self) -> &SharedClock {
        &self.client.clock
    }

    fn now(&self) -> i64 {
        self.clock().now_ms()
    }

    /// One pass over due rows and due receipts, hosts in parallel, then the 72 h sweep
    /// ([`Self::give_up_stale`]). Errors: storage faults (network failures are recorded on the
    /// rows, not returned).
    pub async fn pass(&self) -> Result<PassCounts, MailboxError> {
        let now = self.now();
        let relay = self
            .relay_configured
            .load(std::sync::atomic::Ordering::Acquire);
        let (rows, due_receipts) = self
            .mailbox
            .run(move |c| {
                receipts::expire(c, now)?;
                Ok((
                    outbox::due_for_lan(c, now, MAX_ROWS_PER_PASS, relay)?,
                    receipts::due_for_lan(c, now, MAX_RECEIPTS_PER_PASS, relay)?,
                ))
            })
            .await?;
        let mut by_host: BTreeMap<String, Vec<outbox::Row>> = BTreeMap::new();
        for r in rows {
            by_host.entry(r.host.clone()).or_default().push(r);
        }
        let mut receipts_by_host: BTreeMap<String, Vec<receipts::Row>> = BTreeMap::new();
        for r in due_receipts {
            let list = receipts_by_host.entry(r.host.clone()).or_default();
            if list.len() < RECEIPT_BATCH {
                list.push(r);
            }
        }
        let receipts_due: usize = receipts_by_host.values().map(Vec::len).sum();
        let mut tasks = tokio::task::JoinSet::new();
        for (host, rows) in by_host {
            let this = self.clone();
            tasks.spawn(liveness::inherit(async move {
                this.deliver_host(&host, rows).await
            }));
        }
        for (host, rows) in receipts_by_host {
            let this = self.clone();
            tasks.spawn(liveness::inherit(async move {
                this.flush_receipts(&host, rows).await
            }));
        }
        let mut counts = PassCounts::default();
        let mut first_error = None;
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(Ok(c)) => counts.add(c),
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    first_error.get_or_insert(MailboxError::Task);
                }
            }
        }
        // A LAN failure moves a row (or receipt) toward the relay: let its loop look now.
        if relay && (counts.failed > 0 || counts.receipts_sent < receipts_due) {
            if let Some(w) = &self.relay_wake {
                w.notify_one();
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        counts.gave_up += self.give_up_stale().await?;
        crate::node::settle::settle_pass(&self.mailbox, self.client.ident.clone(), self.now())
            .await?;
        Ok(counts)
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
    /// ahead when it was scheduled; [`outbox::max_horizon_ms`]).
    pub async fn next_due(&self) -> Result<Option<i64>, MailboxError> {
        let relay = self
            .relay_configured
            .load(std::sync::atomic::Ordering::Acquire);
        let now = self.now();
        self.mailbox
            .run(move |c| {
                let rows = outbox::next_due_for_lan(c, relay, now)?;
                let rec = receipts::next_due_for_lan(c, relay, now)?;
                Ok(rows.into_iter().chain(rec).min())
            })
            .await
    }

    /// The peer's enc key: pinned, else fetched from its LAN server (a v1 ad signed by its
    /// pinned host key) and recorded.
    async fn enc_key(&self, peer: &Peer, addr: &str) -> Result<EncPublicKey, String> {
        if let Some(k) = peer.enc_pub.as_deref() {
            if let Ok(k) = EncPublicKey::from_b64(k) {
                return Ok(k);
            }
        }
        liveness::progress();
        let enc = self
            .client
            .get_enc_key(addr, peer)
            .await
            .map_err(|e| format!("no enc key for {}: {e}", peer.host))?;
        let (h, e, now) = (peer.host.clone(), enc.clone(), self.now());
        let ok = self
            .mailbox
            .run(move |c| peers::set_enc_key(c, &h, &e, now))
            .await
            .map_err(|e| e.to_string())?;
        if !ok {
            return Err(format!(
                "no enc key for {}: an enc key with a newer ad is already pinned",
                peer.host
            ));
        }
        EncPublicKey::from_b64(&enc).map_err(|_| format!("no enc key for {}", peer.host))
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
                        counts.add(self.fail_rows(host, &row, &e).await?);
                        rows.retain(|r| r.msg_id != id);
                    }
                    let rest = self.send_sealed(host, &addr, rows).await?;
                    counts.add(rest);
                    return Ok(counts);
                }
                Err(e) => {
                    tracing::warn!(peer = %host, error = %e, "cannot seal for the peer yet");
                    return self.fail_rows(host, &rows, &e).await;
                }
            }
        }
        self.send_sealed(host, &addr, rows).await
    }

    /// Posts sealed rows in batches; the first failed batch fails it and every later row of
    /// the host in this pass.
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
            match paced(host, || self.client.post_envelopes(addr, &wires)).await {
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
                    counts.add(self.fail_rows(host, rest, &e.to_string()).await?);
                    break;
                }
            }
        }
        Ok(counts)
    }

    /// Records a failed LAN attempt for each row in one transaction (giving up after 72 h with
    /// an alert).
    async fn fail_rows(
        &self,
        host: &str,
        rows: &[outbox::Row],
        error: &str,
    ) -> Result<PassCounts, MailboxError> {
        let ids: Vec<String> = rows.iter().map(|r| r.msg_id.clone()).collect();
        let (ident, h, e, now) = (
            self.client.ident.clone(),
            host.to_string(),
            error.to_string(),
            self.now(),
        );
        let gave_up = self
            .mailbox
            .run(move |c| outbound::fail_lan_rows(c, &ident, &h, &ids, &e, now))
            .await?;
        for id in gave_up {
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
        let now = self.now();
        match paced(host, || self.client.post_receipts(&addr, &bytes)).await {
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
                self.mailbox
                    .run(move |c| outbound::fail_lan_receipts(c, &seqs, &err, unsupported, now))
                    .await?;
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
        let delay = match delivery.pass().await {
            Ok(_) => {
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
