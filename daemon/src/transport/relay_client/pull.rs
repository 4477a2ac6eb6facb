//! Pulling, receiving and acknowledging (spec §4; `wire.md` §3.5 "Receive").
//!
//! `GET /v2/relay/items?after=<received_through>&limit=<max_pull>&epoch=<epoch>`; the page is
//! processed in seq order (repeats and items at or below the checkpoint skipped). Each item is
//! one transaction: stored (or a duplicate), or put in quarantine; `received_through` is written
//! in the transaction of the last item of the page, so it only ever covers a prefix processed in
//! order (a crash mid-page re-pulls the rest, and receiver dedup absorbs the repeats). Only after
//! that commit is `POST /v2/relay/ack {epoch, through}` sent; a lost ack is covered by the next.
//! A 429 on the pull or on the ack ends the pass ([`RelayError::ends_pass`]) so the relay loop
//! waits the time the relay gave; the checkpoint already written stays.
//!
//! Every item goes through the inbound path ([`crate::node::inbound`], one transaction per
//! item, the quarantine and the checkpoint written in it by this module): an envelope item to
//! `node::receive`, a repeat of a stored one (a duplicate) queuing the delivery receipts of its
//! current deliveries again in the same transaction (`mailbox::receipts::requeue`; `wire.md`
//! §3.5), so a sender whose first receipt was lost still settles its relay-accepted row (spec
//! §9). A receipt item (spec §9) goes to `node::receipts::accept` with no LAN hop and the item's
//! sender key, which must be the recipient host's pinned key. A `rejected:<why>` of either goes
//! to quarantine as `<why>`. An expiry notice (kind `expired`, spec §6) goes to
//! [`crate::node::settle::apply_expiry_notice`] with the pinned relay key and this relay's URL:
//! the outbox row it names ends `expired` with the sender's alert in the item's transaction when
//! this relay holds it (`relay-accepted` or `repush`, accepted by this relay), and a notice that
//! key did not push or sign, that names no row of this host, or that names a live row this relay
//! does not hold goes to quarantine with its reason. An item that stored mail or queued receipts
//! again wakes the senders' loops once it committed (the inbound path's wake).
//!
//! Quarantined envelopes and receipts are received again ([`RelayClient::retry_quarantined`])
//! once a change to the pins touched their pushing key or the host their wire names, whatever
//! reason was recorded for them: that decision is the `peers` triggers' (schema 5), never the
//! reason text, and a retry refused again only waits for the next such change.
//!
//! Another epoch and going back in time (spec §4, §5): a 409 or a page of another epoch is a new
//! epoch, `head_seq` below the checkpoint or BAD_ACK a rewind; either way
//! [`RelayClient::epoch_changed`] moves the relay's accepted rows to `repush` and resets the
//! position to 0 in one transaction, and everything is pulled again.

use agentmbx_protocol::b64;
use agentmbx_protocol::wire::{AckResponse, PullItem, PullResponse};

use super::session::Session;
use super::{RelayClient, RelayError};
use crate::mailbox::outbox::Repush;
use crate::mailbox::relay_state;
use crate::node::inbound::{Granularity, Inbound, Item, Outcome};
use crate::node::settle;

/// Pages per pull pass (`wire.md` §3.5).
pub const MAX_PAGES_PER_PASS: usize = 20;
/// Quarantined items retried per pass once a pin change touched them (`wire.md` §3.5: ≤100).
pub const MAX_RETRIES_PER_PASS: u32 = 100;

/// Counts of one pull pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PullPass {
    /// Newly stored messages.
    pub stored: usize,
    /// Repeats (already stored).
    pub duplicates: usize,
    /// Delivery receipts queued again for repeats (`wire.md` §3.5).
    pub receipts_requeued: usize,
    /// Items put in quarantine.
    pub quarantined: usize,
    /// Delivery receipts applied (accepted, duplicate or stale).
    pub receipts: usize,
    /// Valid expiry notices applied (a row expired, found delivered, or a repeat).
    pub notices: usize,
    /// The checkpoint after the pass.
    pub received_through: i64,
}

/// Orders a page for processing: by seq, each seq once, only seqs above `through`.
pub fn order_page(mut items: Vec<PullItem>, through: i64) -> Vec<PullItem> {
    items.retain(|i| i.seq > through);
    items.sort_by_key(|i| i.seq);
    items.dedup_by_key(|i| i.seq);
    items
}

impl RelayClient {
    /// `received_through` in `epoch`; a position of another epoch (or none) is an epoch change
    /// ([`Self::epoch_changed`]) and the pull starts at 0.
    pub(super) async fn position(&self, epoch: &str) -> Result<i64, RelayError> {
        let url = self.url.clone();
        let pos = self
            .mailbox
            .run(move |c| relay_state::position(c, &url))
            .await?;
        if let Some(p) = pos.filter(|p| p.epoch == epoch) {
            return Ok(p.received_through);
        }
        self.epoch_changed(
            epoch,
            Repush::Epoch,
            "another epoch than the receive position's",
        )
        .await?;
        Ok(0)
    }

    /// Receives again the quarantined envelopes and receipts marked for another try (at most
    /// [`MAX_RETRIES_PER_PASS`] per pass, oldest first): those whose pushing key or claimed host
    /// a pin change touched since they were last refused (a peer pinned, renamed, unpaired and
    /// paired again, a rotation learned: the `peers` triggers of schema 5 mark them in the
    /// writer's transaction, in every path), whatever reason was recorded first or last. Each is
    /// received like a pulled item (an envelope stored, or found a duplicate whose delivery
    /// receipts are queued again; a receipt applied) and leaves quarantine in one transaction,
    /// or stays with the reason of this refusal, unmarked until the next change that touches it.
    /// Returns how many were received.
    pub async fn retry_quarantined(&self) -> Result<usize, RelayError> {
        let (url, now) = (self.url.clone(), self.clock.now_ms());
        let list_url = url.clone();
        let rows = self
            .mailbox
            .run(move |c| relay_state::retryable(c, &list_url, MAX_RETRIES_PER_PASS))
            .await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let mut rows_of_items = Vec::with_capacity(rows.len());
        let mut items = Vec::with_capacity(rows.len());
        for row in rows {
            items.push(if row.kind == "receipt" {
                Item::ReceiptWire {
                    wire: row.wire,
                    sender_pubkey: row.sender_pubkey,
                }
            } else {
                Item::SealedWire {
                    wire: row.wire,
                    item_id: row.item_id.clone(),
                    sender_pubkey: row.sender_pubkey,
                }
            });
            rows_of_items.push((row.id, row.item_id, row.kind));
        }
        // Each item leaves quarantine, or records why it was refused again, in its own
        // transaction; stored mail or receipts queued again wake the senders' loops.
        let outcomes = self
            .inbound()
            .receive(Granularity::PerItem, items, now, move |tx, i, _, outcome| {
                let (id, item_id, kind) = &rows_of_items[i];
                match outcome {
                    Outcome::Refused(reason) => {
                        tracing::debug!(relay = %url, id = %item_id, kind = %kind, reason = %reason, "quarantined relay item refused again");
                        relay_state::requarantine(tx, *id, reason, now)
                    }
                    _ => relay_state::release(tx, *id),
                }
            })
            .await?;
        let received = outcomes.iter().filter(|o| !o.is_refused()).count();
        if received > 0 {
            tracing::info!(relay = %self.url, received, "received quarantined relay items after a pin change");
        }
        Ok(received)
    }

    /// This relay client's inbound path; it wakes [`RelayClient::received`].
    fn inbound(&self) -> Inbound {
        Inbound::new(
            self.mailbox.clone(),
            self.ident.clone(),
            self.received.clone(),
        )
    }

    /// One pull pass: up to [`MAX_PAGES_PER_PASS`] pages, each followed by its ack.
    pub async fn pull_pass(&self, session: &Session) -> Result<PullPass, RelayError> {
        let mut pass = PullPass::default();
        // A push in this pass may have seen a newer epoch than the session's info.
        let mut epoch = self.current_epoch(&session.epoch).await?;
        let limit = session.limits.max_pull.clamp(1, 500);
        // A page may be larger than other answers (`answer::pull_answer_cap`).
        let cap = super::answer::pull_answer_cap(&session.limits);
        for _ in 0..MAX_PAGES_PER_PASS {
            let through = self.position(&epoch).await?;
            let target = format!(
                "/v2/relay/items?after={through}&limit={limit}&epoch={}",
                super::push::urlencode(&epoch)
            );
            let page: PullResponse = match self.call_json_capped("GET", &target, "", cap).await {
                Ok(p) => p,
                Err(RelayError::Status {
                    status: 409, body, ..
                }) => {
                    let new = body
                        .and_then(|b| b.epoch)
                        .ok_or_else(|| RelayError::Malformed("409 without epoch".into()))?;
                    self.epoch_changed(&new, Repush::Epoch, "stale epoch (409) on pull")
                        .await?;
                    epoch = new;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if page.epoch != epoch {
                self.epoch_changed(&page.epoch, Repush::Epoch, "another epoch in a pull page")
                    .await?;
                epoch = page.epoch;
                continue;
            }
            if page.head_seq < through {
                self.epoch_changed(&epoch, Repush::Rewind, "head_seq below received_through")
                    .await?;
                continue;
            }
            let items = order_page(page.items, through);
            let n = items.len();
            for (i, item) in items.into_iter().enumerate() {
                let last = i + 1 == n;
                crate::liveness::progress();
                self.receive_item(&epoch, item, last, &mut pass).await?;
                if !last {
                    self.failpoints.hit("receive:after-deliver");
                }
            }
            let through = self.position(&epoch).await?;
            pass.received_through = through;
            if !self.ack(&epoch, through).await? {
                // The ack showed a new epoch or a rewind, now recorded.
                epoch = self.current_epoch(&epoch).await?;
                continue;
            }
            if !page.more {
                break;
            }
        }
        Ok(pass)
    }

    /// Processes one item in its own transaction; when `checkpoint` is set the transaction also
    /// moves `received_through` to the item's seq.
    pub(super) async fn receive_item(
        &self,
        epoch: &str,
        item: PullItem,
        checkpoint: bool,
        pass: &mut PullPass,
    ) -> Result<(), RelayError> {
        let (url, ep, now) = (self.url.clone(), epoch.to_string(), self.clock.now_ms());
        let PullItem {
            seq,
            kind,
            item_id,
            sender_pubkey,
            wire_b64,
        } = item;
        // Undecodable base64 is kept as the text received, so quarantine loses nothing.
        let (wire, decoded) = match b64::decode(&wire_b64) {
            Ok(w) => (w, true),
            Err(_) => (wire_b64.into_bytes(), false),
        };
        let received = if !matches!(kind.as_str(), "envelope" | "receipt" | "expired") {
            Item::Unreadable {
                wire,
                reason: format!("unsupported item kind {kind:?}"),
            }
        } else if !decoded || wire.is_empty() {
            Item::Unreadable {
                wire,
                reason: "bad wire".to_string(),
            }
        } else if kind == "expired" {
            Item::ExpiryNotice {
                wire,
                item_id: item_id.clone(),
                sender_pubkey: sender_pubkey.clone(),
                relay_url: url.clone(),
                relay_key: self.relay_key,
            }
        } else if kind == "receipt" {
            Item::ReceiptWire {
                wire,
                sender_pubkey: sender_pubkey.clone(),
            }
        } else {
            Item::SealedWire {
                wire,
                item_id: item_id.clone(),
                sender_pubkey: sender_pubkey.clone(),
            }
        };
        let id = item_id.clone();
        // The item's transaction also quarantines a refused item and, for the last item of a
        // page, moves the checkpoint.
        let outcome = self
            .inbound()
            .receive(
                Granularity::PerItem,
                vec![received],
                now,
                move |tx, _, item, outcome| {
                    if let Outcome::Refused(reason) = outcome {
                        relay_state::quarantine(
                            tx,
                            &url,
                            &ep,
                            seq,
                            &kind,
                            &item_id,
                            &sender_pubkey,
                            reason,
                            item.wire(),
                            now,
                        )?;
                    }
                    if checkpoint {
                        relay_state::set_received_through(tx, &url, &ep, seq, now)?;
                    }
                    Ok(())
                },
            )
            .await?
            .pop()
            .ok_or_else(|| RelayError::Malformed("no outcome for a pulled item".into()))?;
        match outcome {
            Outcome::Stored { delivered } => {
                tracing::info!(seq, id = %id, to = ?delivered, "received from the relay");
                pass.stored += 1;
            }
            Outcome::Duplicate { requeued } => {
                if requeued > 0 {
                    tracing::info!(seq, id = %id, requeued, "repeat from the relay: delivery receipts queued again");
                }
                pass.duplicates += 1;
                pass.receipts_requeued += requeued;
            }
            Outcome::Receipt(result) => {
                tracing::info!(seq, id = %id, result = %result, "delivery receipt from the relay");
                pass.receipts += 1;
            }
            Outcome::Notice(n) => {
                match &n {
                    settle::NoticeOutcome::Expired { msg_id, host, days } => {
                        tracing::warn!(seq, id = %msg_id, peer = %host, days, "Undelivered to {host}: the relay expired it after {days} day(s)");
                    }
                    settle::NoticeOutcome::Delivered { msg_id, host } => {
                        tracing::info!(seq, id = %msg_id, peer = %host, "expiry notice for mail the host had confirmed: delivered");
                    }
                    settle::NoticeOutcome::Repeat {
                        msg_id,
                        host,
                        state,
                    } => {
                        tracing::debug!(seq, id = %msg_id, peer = %host, state = %state, "expiry notice for a settled row: nothing to do");
                    }
                }
                pass.notices += 1;
            }
            Outcome::Refused(reason) => {
                tracing::warn!(seq, id = %id, reason = %reason, "relay item quarantined");
                pass.quarantined += 1;
            }
        }
        Ok(())
    }

    /// Acks `through` when it is above what the relay confirmed. Returns false when the
    /// position was reset (epoch change or BAD_ACK) and the page loop should start over.
    pub(super) async fn ack(&self, epoch: &str, through: i64) -> Result<bool, RelayError> {
        let url = self.url.clone();
        let acked = self
            .mailbox
            .run(move |c| relay_state::position(c, &url))
            .await?
            .map_or(0, |p| p.acked_through);
        if through <= acked {
            return Ok(true);
        }
        self.failpoints.hit("ack:before-send");
        let body = serde_json::json!({"epoch": epoch, "through": through}).to_string();
        let answer = self
            .call_json::<AckResponse>("POST", "/v2/relay/ack", &body)
            .await;
        self.failpoints.hit("ack:after-response");
        match answer {
            Ok(a) => {
                let (url, ep, now) = (self.url.clone(), epoch.to_string(), self.clock.now_ms());
                self.mailbox
                    .run(move |c| {
                        relay_state::set_acked_through(c, &url, &ep, a.acked_through, now)
                    })
                    .await?;
                Ok(true)
            }
            Err(RelayError::Status {
                status: 409, body, ..
            }) => {
                match body.and_then(|b| b.epoch) {
                    Some(new) => {
                        self.epoch_changed(&new, Repush::Epoch, "stale epoch (409) on ack")
                            .await?
                    }
                    None => {
                        self.epoch_changed(epoch, Repush::Rewind, "409 on ack without an epoch")
                            .await?
                    }
                };
                Ok(false)
            }
            Err(RelayError::Status {
                status: 400,
                body: Some(b),
                ..
            }) if b.code == "BAD_ACK" => {
                self.epoch_changed(epoch, Repush::Rewind, "BAD_ACK").await?;
                Ok(false)
            }
            // This host's standing (401/403) or a 429: the pass ends and the loop handles it.
            Err(e) if e.ends_pass() => Err(e),
            Err(e) => {
                tracing::warn!(relay = %self.url, error = %e, "ack failed; the next ack covers it");
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    mod relay;

    fn item(seq: i64) -> PullItem {
        PullItem {
            seq,
            kind: "envelope".into(),
            item_id: format!("i{seq}"),
            sender_pubkey: String::new(),
            wire_b64: String::new(),
        }
    }

    #[test]
    fn pages_are_ordered_deduplicated_and_above_the_checkpoint() {
        let page = vec![item(30), item(10), item(20), item(30), item(5)];
        let seqs: Vec<i64> = order_page(page, 5).iter().map(|i| i.seq).collect();
        assert_eq!(seqs, vec![10, 20, 30]);
    }
}
