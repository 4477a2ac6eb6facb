//! Pushing due outbox rows to the relay (spec §3 sender side; `wire.md` §3.5 "Push").
//!
//! Per row: learn the target's enc key (pinned, or from a v2 ad signed by the target's pinned
//! host key), seal once and persist the wire bytes before the first attempt, then push batches
//! bounded by `max_batch` and by bytes. A row leaves the active outbox only on an accept
//! verified for its target and wire hash; anything else (rejected result, missing result, bad
//! accept, lost response) leaves it pending with backoff, or `rejected` when retrying cannot
//! help (design README "Rejections"), or `undelivered` when the row is more than 72 h old and
//! no relay ever accepted it (`wire.md` §4 "Outbox client"); each of the last two alerts the
//! sender in the transaction that ends the row. An answer about this host rather than the row
//! — 401/403 or a 429 on the push or on an enc-key lookup — charges no row and ends the pass
//! ([`RelayError::ends_pass`]). A refusal showing the target is not enrolled
//! on the relay, or no usable enc-key ad for it there, hands the row back to the LAN when the
//! peer has a LAN address (spec §10, [`crate::transport::select`]). When that refused row is
//! aimed at a key its peer has rotated away from since (a `repush` row accepted before the
//! rotation: the relay revoked the old key), it is retargeted to the pinned key and resealed
//! on its next attempt, due at once, keeping its accept time and deadline
//! ([`outbox::follow_rotations`]; `wire.md` "Resolved details: Resealing").
//!
//! A `repush` row (a relay accepted it before a new epoch or a rewind, spec §5) is pushed like a
//! pending one with its persisted bytes; relay dedup answers `duplicate` where the item
//! survived. A verified accept moves it back to `relay-accepted` with its first accept time and
//! deadline; no refusal ends it (its receipt or deadline does). A verified accept (of a row or
//! of a receipt) of another epoch than the one recorded is a new epoch
//! ([`RelayClient::epoch_changed`]), handled before that row settles. A `rejected:quota:<which>` or `rejected:rate` result keeps the row and
//! backs it off like any retryable refusal (spec §7).

use serde_json::Value;

use agentmbx_protocol::keys::EncPublicKey;
use agentmbx_protocol::wire::{EncKeyAnswer, PushItem, PushRequest, PushResponse, PushTarget};
use agentmbx_protocol::{b64, hash, records};

use super::session::Session;
use super::{RelayClient, RelayError};
use crate::mailbox::outbox::Repush;
use crate::mailbox::{outbox, peers, receipts, MailboxError};
use crate::node::outbound;
use crate::transport::select;

/// Bytes of base64 wire per push request we aim under (the relay's body cap is 8 MiB).
pub const PUSH_BYTES_BUDGET: usize = 6 * 1024 * 1024;
/// Grace after the relay's retention before a relay-accepted row is the sender's own alert
/// (spec §3: 24 h, ms).
pub const DEADLINE_GRACE_MS: i64 = 24 * 3_600_000;

/// Retention (days) above which a relay's published value is not believed for deadlines
/// (100 years; the info answer is not signed).
pub const MAX_RETENTION_DAYS: u64 = 36_500;
/// The smallest item limit a relay may publish and still have over-limit rows treated as
/// terminal: 0.5.x's 512 KiB. Below it the limit is suspect and the row is retried instead.
pub const MIN_TRUSTED_ITEM_LIMIT: u64 = 512 * 1024;

/// Rejections that retrying cannot fix (design README "Rejections").
pub fn is_terminal(reason: &str) -> bool {
    let r = reason.strip_prefix("rejected:").unwrap_or(reason);
    r == "conflict"
        || r.starts_with("bad ")
        || r == "item over size limit"
        || r == "envelope body is not sealed"
        || r.starts_with("item id is not")
        || r == "duplicate target"
        || r == "envelope too large for the relay"
}

/// Outcome counts of one push pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PushPass {
    /// Rows settled as relay-accepted.
    pub accepted: usize,
    /// Rows left pending (or `repush`) or rejected.
    pub failed: usize,
}

impl RelayClient {
    /// The target's enc key: pinned, else a valid v2 ad from the relay signed by the target's
    /// pinned host key (recorded with the rollback guard). `None` when none is available yet.
    async fn target_enc_key(
        &self,
        host: &str,
        target_pubkey: &str,
    ) -> Result<Option<EncPublicKey>, RelayError> {
        let h = host.to_string();
        let peer = self.mailbox.run(move |c| peers::by_name(c, &h)).await?;
        if let Some(k) = peer.as_ref().and_then(|p| p.enc_pub.as_deref()) {
            if let Ok(k) = EncPublicKey::from_b64(k) {
                return Ok(Some(k));
            }
        }
        let target = format!("/v2/relay/enc-key?pubkey={}", urlencode(target_pubkey));
        let answer: EncKeyAnswer = match self.call_json("GET", &target, "").await {
            Ok(a) => a,
            Err(RelayError::Status { status: 404, .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        // Only a valid v2 ad signed by the pinned host key counts; the rollback guard per peer
        // host key refuses an ad not newer than the newest accepted one naming another key
        // (`wire.md` §2.8). A refusal is recorded (and audited once per reason).
        let now = self.clock.now_ms();
        let verdict = super::session::enc_ad_from_answer(&answer, target_pubkey, now);
        let (h, tp) = (host.to_string(), target_pubkey.to_string());
        let refused = self
            .mailbox
            .run(move |c| super::state::accept_enc_ad(c, &h, &tp, verdict, now))
            .await?;
        let ad = match refused {
            Ok(ad) => ad,
            Err(why) => {
                tracing::warn!(peer = %host, reason = %why, "enc-key ad from the relay refused; not sealing with it");
                return Ok(None);
            }
        };
        Ok(EncPublicKey::from_b64(&ad.enc_pub).ok())
    }

    /// Seals the row's message for its target once and persists the wire bytes; returns the
    /// stored bytes (the first ones written, on every later call, by either transport).
    async fn wire_for(&self, row: &outbox::Row) -> Result<Option<Vec<u8>>, RelayError> {
        if let Some(w) = &row.wire {
            return Ok(Some(w.clone()));
        }
        let Some(enc_pub) = self.target_enc_key(&row.host, &row.target_pubkey).await? else {
            return Ok(None);
        };
        let (r, ident) = (row.clone(), self.ident.clone());
        let stored = self
            .mailbox
            .run(move |c| {
                outbound::seal_once(c, &r, &enc_pub, ident.host.as_str(), &ident.host_key)
            })
            .await;
        match stored {
            Ok(w) => Ok(Some(w)),
            Err(MailboxError::Invalid(e)) => Err(RelayError::Malformed(e)),
            Err(e) => Err(RelayError::Store(e)),
        }
    }

    /// One push pass over the due `pending` and `repush` rows the relay takes
    /// ([`outbox::due_for_relay`], spec §10: the LAN failed twice, or the peer has no LAN
    /// address). Network failures leave every row of the batch as it was, backed off.
    pub async fn push_due(&self, session: &Session) -> Result<PushPass, RelayError> {
        let now = self.clock.now_ms();
        let max_batch = session.limits.max_batch.clamp(1, 200) as usize;
        let rows = self
            .mailbox
            .run(move |c| outbox::due_for_relay(c, now, max_batch))
            .await?;
        let mut pass = PushPass::default();
        let mut batch: Vec<(outbox::Row, Vec<u8>)> = Vec::new();
        let mut bytes = 0usize;
        for row in rows {
            let wire = match self.wire_for(&row).await {
                Ok(Some(w)) => w,
                Ok(None) => {
                    // No usable enc key on the relay: the target is not reachable through it
                    // yet, so the LAN gets the next attempt where it can (spec §10).
                    self.fail_row(
                        &row,
                        &format!("no enc key for {} yet", row.host),
                        false,
                        true,
                    )
                    .await?;
                    pass.failed += 1;
                    continue;
                }
                Err(RelayError::Store(e)) => return Err(RelayError::Store(e)),
                // This host's standing (401/403) or a 429, not the row's: the pass handles it
                // and the row is not charged an attempt.
                Err(e) if e.ends_pass() => return Err(e),
                Err(e) => {
                    self.fail_row(&row, &e.to_string(), false, false).await?;
                    pass.failed += 1;
                    continue;
                }
            };
            if wire.len() as u64 > session.limits.max_item_bytes {
                if session.limits.max_item_bytes < MIN_TRUSTED_ITEM_LIMIT {
                    self.fail_row(
                        &row,
                        "the relay publishes an item limit below 512 KiB",
                        false,
                        false,
                    )
                    .await?;
                    pass.failed += 1;
                    continue;
                }
                let failure = self
                    .fail_row(&row, "envelope too large for the relay", true, false)
                    .await?;
                if failure == outbox::Failure::Rejected {
                    tracing::error!(id = %row.msg_id, host = %row.host, bytes = wire.len(), "Undelivered to {}: the sealed envelope is over the relay's item limit", row.host);
                }
                pass.failed += 1;
                continue;
            }
            let size = wire.len().div_ceil(3) * 4;
            if !batch.is_empty() && bytes + size > PUSH_BYTES_BUDGET {
                let done = self.push_batch(session, std::mem::take(&mut batch)).await?;
                pass.accepted += done.accepted;
                pass.failed += done.failed;
                bytes = 0;
            }
            bytes += size;
            batch.push((row, wire));
        }
        if !batch.is_empty() {
            let done = self.push_batch(session, batch).await?;
            pass.accepted += done.accepted;
            pass.failed += done.failed;
        }
        Ok(pass)
    }

    /// Records a failed push of `row` in one transaction: backoff, `rejected` (`terminal`) or
    /// `undelivered` after 72 h, each ending with its alert to the sender. `to_lan` (the relay
    /// cannot reach the row's target) retargets a retried row whose peer rotated away from its
    /// target key ([`outbox::follow_rotations`]) and hands it back to the LAN
    /// ([`outbox::back_to_lan`]).
    async fn fail_row(
        &self,
        row: &outbox::Row,
        error: &str,
        terminal: bool,
        to_lan: bool,
    ) -> Result<outbox::Failure, RelayError> {
        let (m, h, e, now) = (
            row.msg_id.clone(),
            row.host.clone(),
            error.to_string(),
            self.clock.now_ms(),
        );
        let ident = self.ident.clone();
        let outbound::RelayFailed {
            failure,
            handed_back,
            retargeted,
        } = self
            .mailbox
            .run(move |c| outbound::fail_relay_row(c, &ident, &m, &h, &e, terminal, to_lan, now))
            .await?;
        if retargeted > 0 {
            tracing::info!(id = %row.msg_id, peer = %row.host, rows = retargeted, "the peer rotated its key: resealing for the pinned key");
        }
        if failure == outbox::Failure::GaveUp {
            tracing::warn!(id = %row.msg_id, peer = %row.host, "Undelivered to {}: gave up after 72 h", row.host);
        }
        if handed_back {
            tracing::info!(id = %row.msg_id, peer = %row.host, reason = error, "the relay cannot reach the peer yet; the LAN takes the next attempt");
        }
        Ok(failure)
    }

    async fn push_batch(
        &self,
        session: &Session,
        batch: Vec<(outbox::Row, Vec<u8>)>,
    ) -> Result<PushPass, RelayError> {
        let req = PushRequest {
            items: batch
                .iter()
                .map(|(row, wire)| PushItem {
                    kind: "envelope".into(),
                    item_id: row.msg_id.clone(),
                    targets: vec![PushTarget {
                        host_pubkey: row.target_pubkey.clone(),
                        wire_b64: b64::encode(wire),
                    }],
                })
                .collect(),
        };
        let body = serde_json::to_string(&req).map_err(|e| RelayError::Malformed(e.to_string()))?;
        self.failpoints.hit("push:before-send");
        let answer = self
            .call_json::<PushResponse>("POST", "/v2/relay/items", &body)
            .await;
        self.failpoints.hit("push:after-response");
        let mut pass = PushPass::default();
        let results = match answer {
            Ok(r) => r.results,
            Err(e @ RelayError::Store(_)) => return Err(e),
            // Standing or a 429: no row is charged; the pass ends and the loop waits.
            Err(e) if e.ends_pass() => return Err(e),
            Err(e) => {
                tracing::warn!(relay = %self.url, error = %e, rows = batch.len(), "push failed; rows stay pending");
                for (row, _) in &batch {
                    self.fail_row(row, &e.to_string(), false, false).await?;
                }
                pass.failed = batch.len();
                return Ok(pass);
            }
        };
        let me = self.ident.host_key.public().to_b64();
        // The epoch this host recorded: an accept of another one is a new epoch (spec §5).
        let mut known_epoch = self.current_epoch(&session.epoch).await?;
        // Results come back in request order (one per pushed item). One message to several
        // hosts is several items with the same id, so a result is matched by its position and
        // must also name the row's item id.
        for (i, (row, wire)) in batch.iter().enumerate() {
            let wire_hash = hash::sha256_hex(wire);
            let result = results.get(i).filter(|r| r.item_id == row.msg_id);
            let verdict = match result {
                None => Err(("missing result".to_string(), false)),
                Some(r) if r.status == "accepted" || r.status == "duplicate" => {
                    let accept = r.accept.clone().unwrap_or(Value::Null);
                    match records::verify_accept(
                        &accept,
                        r.sig.as_deref().unwrap_or(""),
                        &self.relay_key,
                        &me,
                        &row.msg_id,
                        &row.target_pubkey,
                        &wire_hash,
                    ) {
                        Ok(st) => Ok((st, accept, r.sig.clone().unwrap_or_default())),
                        Err(e) => Err((e.to_string(), false)),
                    }
                }
                Some(r) => Err((r.status.clone(), is_terminal(&r.status))),
            };
            match verdict {
                Ok((st, accept, sig)) => {
                    if st.epoch != known_epoch {
                        self.epoch_changed(
                            &st.epoch,
                            Repush::Epoch,
                            "another epoch in a push accept",
                        )
                        .await?;
                        known_epoch = st.epoch.clone();
                    }
                    let seq = st
                        .targets
                        .iter()
                        .find(|t| t.host_pubkey == row.target_pubkey)
                        .map_or(0, |t| t.seq);
                    let accepted_at = agentmbx_protocol::time::parse_iso_ms(&st.at)
                        .unwrap_or_else(|| self.clock.now_ms());
                    let retention_days =
                        session.limits.retention_days.min(MAX_RETENTION_DAYS) as i64;
                    let deadline = accepted_at
                        .saturating_add(retention_days * 86_400_000)
                        .saturating_add(DEADLINE_GRACE_MS);
                    let (m, h, url, epoch, accept_s, now) = (
                        row.msg_id.clone(),
                        row.host.clone(),
                        self.url.clone(),
                        st.epoch.clone(),
                        accept.to_string(),
                        self.clock.now_ms(),
                    );
                    self.mailbox
                        .run(move |c| {
                            let a = outbox::Accepted {
                                relay: &url,
                                epoch: &epoch,
                                seq,
                                accept: &accept_s,
                                sig: &sig,
                                accepted_at,
                                deadline_at: deadline,
                            };
                            outbound::settle_relay_accept(c, &m, &h, &a, now)
                        })
                        .await?;
                    tracing::info!(id = %row.msg_id, host = %row.host, seq, status = %result.map_or("", |r| r.status.as_str()), "relay accepted");
                    pass.accepted += 1;
                }
                Err((why, terminal)) => {
                    tracing::warn!(id = %row.msg_id, host = %row.host, reason = %why, terminal, "relay push not accepted; row kept");
                    let to_lan = select::relay_cannot_reach(&why);
                    self.fail_row(row, &why, terminal, to_lan).await?;
                    pass.failed += 1;
                }
            }
        }
        Ok(pass)
    }
}

impl RelayClient {
    /// Pushes the due receipts the relay takes (spec §9, §10: the LAN failed twice or the peer
    /// has no LAN address), after dropping those older than 72 h. Each is an item
    /// `kind:"receipt"`, id `receipt:<msg>:<recipient>:<seq>`, with one target, the sending
    /// host's pinned key, and wire `canonical({rec, sig})` signed once and reused. A verified
    /// accept (or duplicate) removes the receipt; a rejection retrying cannot help drops it
    /// (`receipt.rejected`, receipts are advisory); anything else backs it off.
    pub async fn push_receipts(&self, session: &Session) -> Result<PushPass, RelayError> {
        let now = self.clock.now_ms();
        let max_batch = session.limits.max_batch.clamp(1, 200) as usize;
        let ident = self.ident.clone();
        let batch = self
            .mailbox
            .run(move |c| {
                receipts::expire(c, now)?;
                let own = ident.host.as_str();
                let mut out = Vec::new();
                for row in receipts::due_for_relay(c, now, max_batch)? {
                    let wire = outbound::receipt_wire_once(c, &row, own, &ident.host_key)?;
                    let item_id = receipts::record(&row, own).item_id();
                    out.push((row, item_id, wire));
                }
                Ok(out)
            })
            .await?;
        let mut pass = PushPass::default();
        if batch.is_empty() {
            return Ok(pass);
        }
        let req = PushRequest {
            items: batch
                .iter()
                .map(|(row, item_id, wire)| PushItem {
                    kind: "receipt".into(),
                    item_id: item_id.clone(),
                    targets: vec![PushTarget {
                        host_pubkey: row.target_pubkey.clone().unwrap_or_default(),
                        wire_b64: b64::encode(wire),
                    }],
                })
                .collect(),
        };
        let body = serde_json::to_string(&req).map_err(|e| RelayError::Malformed(e.to_string()))?;
        let results = match self
            .call_json::<PushResponse>("POST", "/v2/relay/items", &body)
            .await
        {
            Ok(r) => r.results,
            Err(e @ RelayError::Store(_)) => return Err(e),
            // Standing or a 429: no receipt is charged; the pass ends and the loop waits.
            Err(e) if e.ends_pass() => return Err(e),
            Err(e) => {
                tracing::warn!(relay = %self.url, error = %e, receipts = batch.len(), "receipt push failed; receipts kept");
                let seqs: Vec<i64> = batch.iter().map(|(r, _, _)| r.seq).collect();
                let (err, now) = (e.to_string(), self.clock.now_ms());
                self.mailbox
                    .run(move |c| outbound::fail_receipt_push(c, &seqs, &err, now))
                    .await?;
                pass.failed = batch.len();
                return Ok(pass);
            }
        };
        let me = self.ident.host_key.public().to_b64();
        let (mut done, mut dropped, mut failed) = (Vec::new(), Vec::new(), Vec::new());
        // A verified accept of another epoch than the recorded one is a new epoch (spec §5).
        let mut seen_epoch: Option<String> = None;
        for (i, (row, item_id, wire)) in batch.iter().enumerate() {
            let target = row.target_pubkey.clone().unwrap_or_default();
            let result = results.get(i).filter(|r| &r.item_id == item_id);
            match result {
                Some(r) if r.status == "accepted" || r.status == "duplicate" => {
                    let accept = r.accept.clone().unwrap_or(Value::Null);
                    match records::verify_accept(
                        &accept,
                        r.sig.as_deref().unwrap_or(""),
                        &self.relay_key,
                        &me,
                        item_id,
                        &target,
                        &hash::sha256_hex(wire),
                    ) {
                        Ok(st) => {
                            seen_epoch.get_or_insert(st.epoch);
                            done.push(row.seq);
                        }
                        Err(e) => failed.push((row.seq, e.to_string())),
                    }
                }
                Some(r) if is_terminal(&r.status) => {
                    tracing::warn!(event = "receipt.rejected", id = %row.msg_id, host = %row.host, reason = %r.status, "the relay refused a delivery receipt; dropped");
                    dropped.push(row.seq);
                }
                Some(r) => failed.push((row.seq, r.status.clone())),
                None => failed.push((row.seq, "missing result".to_string())),
            }
        }
        if let Some(epoch) = seen_epoch {
            if epoch != self.current_epoch(&session.epoch).await? {
                self.epoch_changed(&epoch, Repush::Epoch, "another epoch in a push accept")
                    .await?;
            }
        }
        pass.accepted = done.len();
        pass.failed = dropped.len() + failed.len();
        let now = self.clock.now_ms();
        self.mailbox
            .run(move |c| outbound::settle_receipt_push(c, &done, &dropped, &failed, now))
            .await?;
        if pass.accepted > 0 {
            tracing::info!(relay = %self.url, receipts = pass.accepted, "delivery receipts accepted by the relay");
        }
        Ok(pass)
    }
}

/// Percent-encodes a query value (base64 keys carry `+`, `/`, `=`).
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests;
