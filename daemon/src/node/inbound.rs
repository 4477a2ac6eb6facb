//! The one inbound path: what every transport does with the envelopes, delivery receipts and
//! relay expiry notices it received (spec §4, §6, §9; `wire.md` §3.5 "Receive", §4 `receive`).
//!
//! A transport turns what it read into [`Item`]s, each saying how its sender was verified (the
//! LAN hop's peer, or the relay item's sender key), and hands a batch to [`receive_items`] (on
//! the caller's connection) or to [`Inbound::receive`] (on the mailbox thread, then the wake).
//! Each item is received ([`receive::receive`], [`receive::receive_sealed`],
//! [`receipts::accept`], [`settle::apply_expiry_notice`]); a repeat of a stored envelope (a
//! duplicate) queues the delivery receipts of its current deliveries again in the same
//! transaction ([`receipt_queue::requeue`], `wire.md` §3.5), so a sender whose first receipt
//! was lost still settles. Each item comes to one [`Outcome`].
//!
//! Transaction granularity is the caller's ([`Granularity`]), because it places the crash
//! windows the drills test: the LAN answers a batch after one transaction with a savepoint per
//! envelope, the relay pull and the quarantine retry commit one transaction per item. The
//! caller's own writes for an item (quarantine, the pull checkpoint) go in that item's
//! transaction through the `after` hook, so they commit atomically with it.
//!
//! This module owns the receive duty and the one wake point of received mail
//! ([`Inbound::receive`] notifies the senders' loop after the commit, when mail was stored or
//! receipts were queued again). It never touches the network, never logs (the transports log
//! their own lines), never quarantines or moves a checkpoint itself, and never keeps what a
//! refused item wrote inside its savepoint.

use std::sync::Arc;

use rusqlite::{Connection, TransactionBehavior};
use serde_json::Value;
use tokio::sync::Notify;

use agentmbx_protocol::keys::PublicKey;

use crate::identity::Identity;
use crate::mailbox::peers::Peer;
use crate::mailbox::{receipts as receipt_queue, Mailbox, MailboxError};
use crate::node::{receipts, receive, settle};

/// One received item and how its sender was verified.
#[derive(Debug, Clone)]
pub enum Item {
    /// An envelope a LAN peer delivered (parsed JSON), from the hop's verified peer `hop`.
    Envelope {
        /// The envelope as received.
        env: Value,
        /// The pinned peer the LAN hop verified.
        hop: Peer,
    },
    /// Sealed envelope wire bytes that a relay says `sender_pubkey` pushed as `item_id`; the
    /// key must name a pinned peer (its current key or one it retired).
    SealedWire {
        /// The envelope's canonical bytes.
        wire: Vec<u8>,
        /// The relay item id (must be the envelope id).
        item_id: String,
        /// The relay-verified pushing host key (base64).
        sender_pubkey: String,
    },
    /// A delivery receipt `{rec, sig}` a LAN peer sent (parsed JSON), from the hop's peer.
    Receipt {
        /// The receipt as received.
        receipt: Value,
        /// The pinned peer the LAN hop verified.
        hop: Peer,
    },
    /// Delivery receipt wire bytes `canonical({rec, sig})` pushed through a relay by
    /// `sender_pubkey`, which must be the recipient host's pinned (or retired) key.
    ReceiptWire {
        /// The receipt's canonical bytes.
        wire: Vec<u8>,
        /// The relay-verified pushing host key (base64).
        sender_pubkey: String,
    },
    /// A relay's expiry notice (item kind `expired`, spec §6) for one of this host's rows.
    ExpiryNotice {
        /// The notice's wire bytes.
        wire: Vec<u8>,
        /// The relay item id.
        item_id: String,
        /// The relay-verified pushing key (must be the relay's own).
        sender_pubkey: String,
        /// The relay's URL (the outbox row must be held by this relay).
        relay_url: String,
        /// The relay's pinned key.
        relay_key: PublicKey,
    },
    /// An item the transport could not read (an unknown kind, undecodable wire): refused with
    /// `reason`, nothing received. `wire` is the text as it came (for quarantine).
    Unreadable {
        /// The bytes as received.
        wire: Vec<u8>,
        /// The refusal reason.
        reason: String,
    },
}

impl Item {
    /// The wire bytes the item came as (empty for the parsed LAN items): what quarantine keeps.
    pub fn wire(&self) -> &[u8] {
        match self {
            Item::SealedWire { wire, .. }
            | Item::ReceiptWire { wire, .. }
            | Item::ExpiryNotice { wire, .. }
            | Item::Unreadable { wire, .. } => wire,
            Item::Envelope { .. } | Item::Receipt { .. } => &[],
        }
    }
}

/// What receiving one item came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An envelope stored now, delivered to these local agents (held names not listed).
    Stored {
        /// Local agent names that got a delivery.
        delivered: Vec<String>,
    },
    /// An envelope already stored from the same sender; this many delivery receipts were
    /// queued again.
    Duplicate {
        /// Receipts queued again ([`receipt_queue::requeue`]).
        requeued: usize,
    },
    /// A delivery receipt applied: `accepted`, `duplicate` or `stale`.
    Receipt(String),
    /// A valid relay expiry notice applied.
    Notice(settle::NoticeOutcome),
    /// Refused (the text after `rejected:`, or the quarantine reason): nothing of it kept.
    Refused(String),
}

impl Outcome {
    /// Whether the item was refused.
    pub fn is_refused(&self) -> bool {
        matches!(self, Outcome::Refused(_))
    }

    /// Whether the senders' loop has work because of this item: mail stored (its deliveries
    /// queued receipts) or receipts queued again for a duplicate.
    pub fn wakes_senders(&self) -> bool {
        match self {
            Outcome::Stored { .. } => true,
            Outcome::Duplicate { requeued } => *requeued > 0,
            _ => false,
        }
    }

    /// The result text a LAN batch answers for the item (`wire.md` §4): `accepted` (stored,
    /// or a notice applied), `duplicate`, a receipt's `accepted`/`duplicate`/`stale`, or
    /// `rejected:<why>`.
    pub fn answer(&self) -> String {
        match self {
            Outcome::Stored { .. } | Outcome::Notice(_) => "accepted".into(),
            Outcome::Duplicate { .. } => "duplicate".into(),
            Outcome::Receipt(result) => result.clone(),
            Outcome::Refused(why) => format!("rejected:{why}"),
        }
    }
}

/// Transactions of one batch (the crash windows of each transport).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One `IMMEDIATE` transaction for the batch, each item in its own savepoint, released
    /// unless the item was refused (the LAN envelopes handler).
    BatchWithSavepoints,
    /// One `IMMEDIATE` transaction for the batch, no savepoint per item (the LAN receipts
    /// handler: [`receipts::accept`] keeps its writes under its own savepoint).
    Batch,
    /// One (deferred) transaction per item, committed whatever its outcome (the relay pull and
    /// the quarantine retry, whose `after` writes quarantine and the checkpoint).
    PerItem,
}

/// Receives one item inside the caller's transaction (module docs). `Err(_)` is a storage
/// fault only (the caller retries; nothing is quarantined for a fault of ours).
pub fn receive_one(
    conn: &Connection,
    ident: &Identity,
    item: &Item,
    now_ms: i64,
) -> Result<Outcome, MailboxError> {
    let envelope =
        |verdict: Result<receive::Verdict, String>, id: &str| -> Result<Outcome, MailboxError> {
            Ok(match verdict {
                Ok(receive::Verdict::Stored { delivered }) => Outcome::Stored { delivered },
                // The sender asks again: its receipts may have been lost or expired, so the
                // current delivery states go back to it (`wire.md` §3.5).
                Ok(receive::Verdict::Duplicate) => Outcome::Duplicate {
                    requeued: receipt_queue::requeue(conn, id, now_ms)?,
                },
                Err(why) => Outcome::Refused(why),
            })
        };
    let receipt = |result: String| match result.strip_prefix("rejected:") {
        Some(why) => Outcome::Refused(why.to_string()),
        None => Outcome::Receipt(result),
    };
    let own = ident.host.as_str();
    match item {
        Item::Envelope { env, hop } => {
            let id = env.get("id").and_then(Value::as_str).unwrap_or_default();
            envelope(receive::receive(conn, ident, env, hop, now_ms)?, id)
        }
        Item::SealedWire {
            wire,
            item_id,
            sender_pubkey,
        } => envelope(
            receive::receive_sealed(conn, ident, wire, item_id, sender_pubkey, now_ms)?,
            item_id,
        ),
        Item::Receipt { receipt: r, hop } => Ok(receipt(receipts::accept(
            conn,
            own,
            r,
            Some(hop),
            None,
            now_ms,
        )?)),
        // Spec §9 `acceptReceipt(node, item, null)`: no hop, the item's sender key.
        Item::ReceiptWire {
            wire,
            sender_pubkey,
        } => {
            let Ok(value) = agentmbx_protocol::canonical::parse(wire) else {
                return Ok(Outcome::Refused("invalid receipt".into()));
            };
            Ok(receipt(receipts::accept(
                conn,
                own,
                &value,
                None,
                Some(sender_pubkey),
                now_ms,
            )?))
        }
        Item::ExpiryNotice {
            wire,
            item_id,
            sender_pubkey,
            relay_url,
            relay_key,
        } => Ok(
            match settle::apply_expiry_notice(
                conn,
                ident,
                relay_url,
                relay_key,
                item_id,
                sender_pubkey,
                wire,
                now_ms,
            )? {
                Ok(n) => Outcome::Notice(n),
                Err(why) => Outcome::Refused(why),
            },
        ),
        Item::Unreadable { reason, .. } => Ok(Outcome::Refused(reason.clone())),
    }
}

/// Receives `items` in order on `conn` with the transactions of `granularity`, at `now_ms`.
/// After each item, `after(conn, index, item, outcome)` adds the caller's writes to the same
/// transaction (for [`Granularity::BatchWithSavepoints`], outside the item's savepoint: they
/// stay even when the item was refused); an error from it (or a storage fault) rolls back the
/// open transaction and is returned, items committed before stay. Returns one outcome per
/// item, in order.
pub fn receive_items<A>(
    conn: &mut Connection,
    ident: &Identity,
    granularity: Granularity,
    items: &[Item],
    now_ms: i64,
    mut after: A,
) -> Result<Vec<Outcome>, MailboxError>
where
    A: FnMut(&Connection, usize, &Item, &Outcome) -> Result<(), MailboxError>,
{
    let mut outcomes = Vec::with_capacity(items.len());
    if granularity == Granularity::PerItem {
        for (i, item) in items.iter().enumerate() {
            let tx = conn.transaction()?;
            let outcome = receive_one(&tx, ident, item, now_ms)?;
            after(&tx, i, item, &outcome)?;
            tx.commit()?;
            outcomes.push(outcome);
        }
        return Ok(outcomes);
    }
    let mut tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    for (i, item) in items.iter().enumerate() {
        let outcome = if granularity == Granularity::BatchWithSavepoints {
            let sp = tx.savepoint()?;
            let outcome = receive_one(&sp, ident, item, now_ms)?;
            if outcome.is_refused() {
                // Savepoint dropped: anything a refused item touched is rolled back.
                drop(sp);
            } else {
                // Stored, or a duplicate whose receipts were queued again.
                sp.commit()?;
            }
            outcome
        } else {
            receive_one(&tx, ident, item, now_ms)?
        };
        after(&tx, i, item, &outcome)?;
        outcomes.push(outcome);
    }
    tx.commit()?;
    Ok(outcomes)
}

/// The inbound path of one daemon: its store, its identity and the senders' wake.
#[derive(Debug, Clone)]
pub struct Inbound {
    /// The host store.
    pub mailbox: Mailbox,
    /// This host's identity (opens sealed bodies, names the receipts' own host).
    pub ident: Arc<Identity>,
    /// Notified after a commit that stored mail or queued receipts again, so the senders'
    /// loop does not wait out its sleep; `None` wakes nobody.
    pub wake: Option<Arc<Notify>>,
}

impl Inbound {
    /// The inbound path over `mailbox` for `ident`, waking `wake`.
    pub fn new(mailbox: Mailbox, ident: Arc<Identity>, wake: Option<Arc<Notify>>) -> Self {
        Inbound {
            mailbox,
            ident,
            wake,
        }
    }

    /// [`receive_items`] on the mailbox thread; then, once committed, the one wake point: the
    /// senders' loop is notified when any item [`Outcome::wakes_senders`]. Errors: storage
    /// faults (and `after`'s errors); the open transaction was rolled back.
    pub async fn receive<A>(
        &self,
        granularity: Granularity,
        items: Vec<Item>,
        now_ms: i64,
        after: A,
    ) -> Result<Vec<Outcome>, MailboxError>
    where
        A: FnMut(&Connection, usize, &Item, &Outcome) -> Result<(), MailboxError> + Send + 'static,
    {
        let ident = self.ident.clone();
        let outcomes = self
            .mailbox
            .run(move |c| receive_items(c, &ident, granularity, &items, now_ms, after))
            .await?;
        if outcomes.iter().any(Outcome::wakes_senders) {
            if let Some(wake) = &self.wake {
                wake.notify_one();
            }
        }
        Ok(outcomes)
    }
}

/// An `after` hook that adds nothing.
pub fn nothing_after(_: &Connection, _: usize, _: &Item, _: &Outcome) -> Result<(), MailboxError> {
    Ok(())
}

#[cfg(test)]
mod tests;
