//! Items: the [`ItemStore`] trait and its request and outcome types (spec §3, §4; `wire.md`
//! §3.2 "Push (v2)", "Pull", "Ack"). Backend-neutral: no SQL here, only what a backend must do.

use super::StoreError;

/// When pushed items expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Expiry {
    /// `expires_at = accepted_at + retention_days` (spec §6). Every v2 push.
    #[default]
    Retention,
    /// Never (items pushed through the v1 endpoints, `wire.md` §3.2 "Sweep").
    Never,
}

/// One target of a pushed item: the exact wire bytes sealed for that host (spec §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    /// The target host key.
    pub target_pubkey: String,
    /// The exact bytes to store (decoded from `wire_b64`), shared: the push handler keeps a
    /// handle to publish them on the target's push stream after the commit.
    pub wire: bytes::Bytes,
}

/// One pushed item, validated by the handler (id, kind, size, wire shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushItem {
    /// `envelope`, `receipt` or `expired`.
    pub kind: String,
    /// The item id (the dedup key together with sender and target).
    pub item_id: String,
    /// One entry per target host, in the order the sender gave them.
    pub targets: Vec<PushTarget>,
}

/// One push request from one authenticated sender (`POST /v2/relay/items`, spec §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushBatch {
    /// The hop-authenticated sender's host key.
    pub sender_pubkey: String,
    /// The sender's host name (stored as `items.sender_host`; v1 pulls show it).
    pub sender_host: String,
    /// Now, in ms: the acceptance time and the sequence floor.
    pub now_ms: i64,
    /// Whether the items expire.
    pub expiry: Expiry,
    /// The items, applied in order; later items see earlier ones.
    pub items: Vec<PushItem>,
}

/// The reply of [`ItemStore::push_then`].
pub type PushReply = Box<dyn FnOnce(Result<PushOutcome, StoreError>) + Send>;

/// Which quota refused an item (spec §7, `wire.md` §3.2 "Quotas").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaKind {
    /// Items queued for the target.
    QueueDepth,
    /// Bytes queued for the target.
    QueueBytes,
    /// This sender's items or bytes queued for the target.
    SenderShare,
    /// Items queued across the target's proven account.
    OwnerQueueDepth,
    /// Bytes queued across the target's proven account.
    OwnerQueueBytes,
}

/// Why the store rejected an item. Nothing of a rejected item is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The item has no targets (`bad targets`).
    BadTargets,
    /// A target is not enrolled or is revoked (`target not enrolled`).
    TargetNotEnrolled,
    /// A target's allowlist does not name the sender (`sender not accepted by target`).
    SenderNotAccepted,
    /// The same target appears twice (`duplicate target`).
    DuplicateTarget,
    /// The same (sender, item id, target) was stored with other bytes (`conflict`).
    Conflict,
    /// A quota would be exceeded (`quota:<which> exceeded for <host>`).
    Quota {
        /// Which quota.
        kind: QuotaKind,
        /// The target's enrolled name, for the message.
        host: String,
    },
}

impl Rejection {
    /// The code after `rejected:` on the wire (`wire.md` §3.2 rejection strings), e.g.
    /// `quota:queue depth exceeded for beta`.
    pub fn code(&self) -> String {
        match self {
            Self::BadTargets => "bad targets".to_owned(),
            Self::TargetNotEnrolled => "target not enrolled".to_owned(),
            Self::SenderNotAccepted => "sender not accepted by target".to_owned(),
            Self::DuplicateTarget => "duplicate target".to_owned(),
            Self::Conflict => "conflict".to_owned(),
            Self::Quota { kind, host } => {
                let what = match kind {
                    QuotaKind::QueueDepth => "queue depth",
                    QuotaKind::QueueBytes => "queue bytes",
                    QuotaKind::SenderShare => "sender share",
                    QuotaKind::OwnerQueueDepth => "owner queue depth",
                    QuotaKind::OwnerQueueBytes => "owner queue bytes",
                };
                format!("quota:{what} exceeded for {host}")
            }
        }
    }
}

/// The status of one pushed item (spec §3 "Response").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemStatus {
    /// At least one target was stored fresh.
    Accepted,
    /// Every target was already stored with the same bytes.
    Duplicate,
    /// Refused as a whole; nothing stored.
    Rejected(Rejection),
}

impl ItemStatus {
    /// The wire text: `accepted`, `duplicate` or `rejected:<code>`.
    pub fn wire(&self) -> String {
        match self {
            Self::Accepted => "accepted".to_owned(),
            Self::Duplicate => "duplicate".to_owned(),
            Self::Rejected(r) => format!("rejected:{}", r.code()),
        }
    }
}

/// One target of an accepted or duplicate item: what the accept receipt signs (spec §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetAccept {
    /// The target host key.
    pub target_pubkey: String,
    /// The item's seq in that target's queue (the original one for a duplicate).
    pub seq: i64,
    /// Lowercase hex SHA-256 of the stored wire bytes.
    pub wire_hash: String,
}

/// The store's verdict on one pushed item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemOutcome {
    /// The item id, as pushed.
    pub item_id: String,
    /// Accepted, duplicate or rejected.
    pub status: ItemStatus,
    /// The accept time for the receipt's `at`, in ms: now if any target was fresh, else the
    /// earliest original `accepted_at` (so retries never move the sender's deadline). `None`
    /// when rejected.
    pub at_ms: Option<i64>,
    /// Per target, in push order; empty when rejected.
    pub targets: Vec<TargetAccept>,
    /// Per target, in push order (empty when rejected): for a target this push stored fresh,
    /// the target's head seq just before its `seq` was allocated (0 if none), read in the same
    /// transaction, so no item for the target lies strictly between the two (the push stream's
    /// `deliver.prev_seq`, `docs/relay-stream.md`); `None` for a target settled by dedup
    /// (nothing new stored, nothing to publish).
    pub prev_seqs: Vec<Option<i64>>,
}

/// The result of [`ItemStore::push`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushOutcome {
    /// The epoch the items were committed under (read in the same transaction), for the accept
    /// receipts.
    pub epoch: String,
    /// One outcome per pushed item, in order.
    pub items: Vec<ItemOutcome>,
}

/// A pull request (`GET /v2/relay/items`, spec §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRequest {
    /// The authenticated caller's host key (its own queue).
    pub target_pubkey: String,
    /// Return items with `seq > after` (negative is read as 0).
    pub after: i64,
    /// Page size, clamped to `1..=`[`MAX_PULL_ITEMS`](crate::store::MAX_PULL_ITEMS).
    pub limit: i64,
    /// Byte budget over the page's wire bytes; the page stops before exceeding it but always
    /// holds at least one item when one exists (`wire.md` "Pull byte budget").
    pub max_bytes: u64,
}

/// One pulled item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledItem {
    /// Its seq in the caller's queue.
    pub seq: i64,
    /// `envelope`, `receipt` or `expired`.
    pub kind: String,
    /// The item id.
    pub item_id: String,
    /// The sender's host key.
    pub sender_pubkey: String,
    /// The sender's host name (v1 pulls show it).
    pub sender_host: String,
    /// The exact stored bytes.
    pub wire: Vec<u8>,
}

/// One pull page (spec §4), read from one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullPage {
    /// The current epoch.
    pub epoch: String,
    /// The last seq allocated for the caller (`next_seq − 1`, 0 if none).
    pub head_seq: i64,
    /// The page, in seq order.
    pub items: Vec<PulledItem>,
    /// The seq of the last item returned, or `after` when the page is empty.
    pub last_seq: i64,
    /// Whether more items follow this page.
    pub more: bool,
}

/// An acknowledgement (`POST /v2/relay/ack`, spec §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckRequest {
    /// The authenticated caller's host key.
    pub target_pubkey: String,
    /// Delete items with `seq <= through`; outside `[0, head_seq]` the answer is
    /// [`AckResult::OutOfRange`] (any i64 is a valid request).
    pub through: i64,
    /// When set, the ack applies only if this is still the current epoch (checked in the same
    /// transaction), else [`AckResult::StaleEpoch`].
    pub epoch: Option<String>,
}

/// A successful acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckOutcome {
    /// `max(previous acked_through, through)`: it never decreases.
    pub acked_through: i64,
    /// How many items were deleted.
    pub deleted: u64,
    /// The last seq allocated for the caller.
    pub head_seq: i64,
    /// The epoch the ack was committed under.
    pub epoch: String,
}

/// The result of [`ItemStore::ack`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckResult {
    /// Done.
    Acked(AckOutcome),
    /// `through` is outside `[0, head_seq]` (negative, or past the last allocated seq):
    /// nothing changed (400 BAD_ACK; the receiver treats it as an epoch change, spec §4,
    /// `wire.md` §3.2 "Ack").
    OutOfRange {
        /// The last allocated seq.
        head_seq: i64,
        /// The current epoch.
        epoch: String,
    },
    /// The request named an epoch that is not current: nothing changed (409 EPOCH).
    StaleEpoch {
        /// The current epoch.
        epoch: String,
        /// The last allocated seq.
        head_seq: i64,
    },
}

/// A host's queue position (`info` `you`, spec §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostQueueInfo {
    /// The last seq allocated for the host (0 if none).
    pub head_seq: i64,
    /// The highest seq the host acknowledged (0 if none).
    pub acked_through: i64,
}

/// Items (spec §3, §4): push with dedup and all-or-nothing fan-out, seq allocation, quotas,
/// pull pages and acks. Blocking, like every store trait (see [`RelayStore`](crate::store::RelayStore)).
pub trait ItemStore: Send + Sync + std::fmt::Debug {
    /// Store validated items (spec §3): per item, dedup by (sender, item id, target) first —
    /// a target already stored under this item answers `duplicate` (same bytes) or `conflict`
    /// whatever its enrolment or allowlist says now — then every fresh target validated
    /// (enrolled, sender allowed, not repeated) before seq allocation and quotas; one outcome
    /// per item.
    fn push(&self, batch: PushBatch) -> Result<PushOutcome, StoreError>;

    /// [`ItemStore::push`] without holding the caller: `done` gets the same result once the
    /// group commit that covers the batch has committed (or failed), on whatever thread
    /// finished it (the writer's, for [`SqliteStore`](crate::store::SqliteStore)), so an async handler awaits a channel
    /// instead of parking a blocking thread per request. `done` must not block. The default
    /// runs [`ItemStore::push`] on the calling thread.
    fn push_then(&self, batch: PushBatch, done: PushReply) {
        done(self.push(batch))
    }

    /// The target keys that already have a dedup row for (sender, item id), i.e. for which a
    /// push of this item was accepted earlier (its bytes may since have been acked or expired).
    /// The push handler skips its enrolment and allowlist pre-checks for these targets, so a
    /// retry after the target changed still settles as `duplicate`.
    fn dedup_targets(&self, sender_pubkey: &str, item_id: &str) -> Result<Vec<String>, StoreError>;

    /// One page of a host's queue (spec §4).
    fn pull(&self, req: PullRequest) -> Result<PullPage, StoreError>;

    /// Acknowledge through a seq: deletes those items, records `acked_through` (spec §4).
    fn ack(&self, req: AckRequest) -> Result<AckResult, StoreError>;

    /// A host's queue head and ack position.
    fn info_for(&self, host_pubkey: &str) -> Result<HostQueueInfo, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejection_codes_match_the_wire_strings() {
        let host = "beta".to_owned();
        let q = |kind| {
            ItemStatus::Rejected(Rejection::Quota {
                kind,
                host: host.clone(),
            })
        };
        assert_eq!(
            q(QuotaKind::QueueDepth).wire(),
            "rejected:quota:queue depth exceeded for beta"
        );
        assert_eq!(
            q(QuotaKind::QueueBytes).wire(),
            "rejected:quota:queue bytes exceeded for beta"
        );
        assert_eq!(
            q(QuotaKind::SenderShare).wire(),
            "rejected:quota:sender share exceeded for beta"
        );
        assert_eq!(
            q(QuotaKind::OwnerQueueDepth).wire(),
            "rejected:quota:owner queue depth exceeded for beta"
        );
        assert_eq!(
            ItemStatus::Rejected(Rejection::SenderNotAccepted).wire(),
            "rejected:sender not accepted by target"
        );
        assert_eq!(
            ItemStatus::Rejected(Rejection::Conflict).wire(),
            "rejected:conflict"
        );
        assert_eq!(ItemStatus::Accepted.wire(), "accepted");
        assert_eq!(ItemStatus::Duplicate.wire(), "duplicate");
    }
}
