//! Request and response bodies of the relay API (`wire.md` §3.1, spec §1, §3, §4).
//!
//! Incoming bodies are parsed leniently about unknown fields (0.5.x peers may add some) and
//! strictly about types. Outgoing bodies are serialized in 0.5.x's field order.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `{error, code}`, the error body of every endpoint, with the extra fields some errors carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Human text.
    pub error: String,
    /// Stable machine code (e.g. `EPOCH`, `BAD_ACK`, `NOT_ENROLLED`).
    pub code: String,
    /// Current epoch (EPOCH, BAD_ACK).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<String>,
    /// Current head seq (EPOCH, BAD_ACK).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_seq: Option<i64>,
    /// Seconds to wait (RATE_LIMIT).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// Published relay limits (GET /v2/relay/info).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest decoded wire item (bytes).
    pub max_item_bytes: u64,
    /// Items per push.
    pub max_batch: u64,
    /// Items per pull page.
    pub max_pull: u64,
    /// Byte budget of a pull page.
    pub max_pull_bytes: u64,
    /// Targets per item.
    pub max_targets: u64,
    /// Retention (days).
    pub retention_days: u64,
    /// Per target queue items.
    pub max_queue_items: u64,
    /// Per target queue bytes.
    pub max_queue_bytes: u64,
    /// Per sender per target items.
    pub max_sender_items: u64,
    /// Per sender per target bytes.
    pub max_sender_bytes: u64,
    /// Per account items.
    pub max_owner_items: u64,
    /// Per account bytes.
    pub max_owner_bytes: u64,
}

/// `you.enc_ad` in signed info.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct YouEncAd {
    /// The enc key the relay serves for the caller.
    pub enc_pub: String,
    /// ISO expiry of the v2 ad ("" for v1).
    pub exp: String,
    /// True when the relay holds only an unexpiring v1 ad.
    pub v1: bool,
}

/// `you` in signed info: the caller as the relay knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct You {
    /// Enrolled host name.
    pub host: String,
    /// Enrolled host key.
    pub pubkey: String,
    /// Last seq allocated for the caller.
    pub head_seq: i64,
    /// Highest seq the caller acked.
    pub acked_through: i64,
    /// The caller's ad, if any.
    pub enc_ad: Option<YouEncAd>,
    /// Set while the relay sees more than one daemon instance alternate on the caller's host
    /// key (a cloned home or disk; [`crate::instance`]). An added field that 0.5.x ignores;
    /// absent when there is none. Advisory only. Its `since_ms` and `last_ms` are on the
    /// relay's own monotonic clock (ms since the relay process started): compare them only
    /// with each other (a changed `since_ms` is a new detection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_conflict: Option<crate::instance::InstanceConflict>,
    /// A fresh single-use nonce for opening the push stream (`GET /v2/relay/stream?nonce=…`,
    /// [`crate::stream`]), valid for [`crate::stream::NONCE_TTL_MS`]. An added field that 0.5.x
    /// ignores; absent from a relay without the stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_nonce: Option<String>,
}

/// GET /v2/relay/info.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayInfo {
    /// Always 2.
    pub v: u8,
    /// The relay key (base64).
    pub relay_pubkey: String,
    /// Current epoch.
    pub epoch: String,
    /// Relay software version.
    pub version: String,
    /// Published limits.
    pub limits: Limits,
    /// Only for a verified, enrolled caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub you: Option<You>,
}

/// POST /v1/relay/challenge request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChallengeRequest {
    /// Host name (HOST_RE).
    pub host: String,
    /// Host key (base64).
    pub pubkey: String,
}

/// POST /v1/relay/challenge response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChallengeResponse {
    /// 16 random bytes, base64url without padding.
    pub challenge: String,
}

/// POST /v1/relay/enrol request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnrolRequest {
    /// Host name.
    pub host: String,
    /// Host key (base64).
    pub pubkey: String,
    /// Owner fingerprint or "" (unproven claim; decides nothing).
    #[serde(default)]
    pub owner_fp: String,
    /// Signature over [`crate::records::enrol_canonical`].
    pub sig: String,
    /// Authority proof (account tokens); absent for the host-key challenge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<Value>,
}

/// One target of a pushed item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushTarget {
    /// Target host key (base64).
    pub host_pubkey: String,
    /// Wire bytes, standard base64.
    pub wire_b64: String,
}

/// One pushed item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushItem {
    /// `envelope` or `receipt`.
    pub kind: String,
    /// Envelope id or `receipt:msg:recipient:seq`.
    pub item_id: String,
    /// One per target host.
    pub targets: Vec<PushTarget>,
}

/// POST /v2/relay/items request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushRequest {
    /// At most `max_batch` items.
    pub items: Vec<PushItem>,
}

/// `{host_pubkey, seq}` in a push result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetSeq {
    /// Target host key.
    pub host_pubkey: String,
    /// Allocated (or original) seq.
    pub seq: i64,
}

/// Per item push result: status `accepted`, `duplicate` or `rejected:<why>`. `A` is how the
/// accept statement is held: a parsed [`Value`] for a reader (verified as received), or the
/// relay's already canonical text (`Box<serde_json::value::RawValue>`) for the writer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "A: Deserialize<'de>"))]
pub struct PushResult<A = Value> {
    /// The item id as pushed.
    pub item_id: String,
    /// `accepted` | `duplicate` | `rejected:<why>`.
    pub status: String,
    /// Seqs per target (empty when rejected).
    #[serde(default)]
    pub targets: Vec<TargetSeq>,
    /// The signed accept statement (accepted/duplicate only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept: Option<A>,
    /// Relay signature over canonical(accept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

/// POST /v2/relay/items response (HTTP 200 = "results are in this body").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "A: Deserialize<'de>"))]
pub struct PushResponse<A = Value> {
    /// One per pushed item, same order.
    pub results: Vec<PushResult<A>>,
}

/// One pulled item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullItem {
    /// Relay seq.
    pub seq: i64,
    /// `envelope`, `receipt` or `expired`.
    pub kind: String,
    /// Item id.
    pub item_id: String,
    /// Pushing host key (the relay key for notices).
    pub sender_pubkey: String,
    /// Wire bytes, standard base64.
    pub wire_b64: String,
}

/// GET /v2/relay/items response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullResponse {
    /// Current epoch.
    pub epoch: String,
    /// Last seq allocated for the caller.
    pub head_seq: i64,
    /// The page, in seq order.
    pub items: Vec<PullItem>,
    /// Last seq returned (or `after` when empty).
    pub last_seq: i64,
    /// More items exist after this page.
    pub more: bool,
}

/// POST /v2/relay/ack request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AckRequest {
    /// Epoch the receiver pulled in.
    pub epoch: String,
    /// Highest seq durably processed. An integer outside `[0, head_seq]` (a negative one
    /// included) is answered 400 `BAD_ACK` with `epoch` and `head_seq` (`wire.md` §3.2).
    pub through: Value,
}

/// POST /v2/relay/ack response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckResponse {
    /// max(old, through).
    pub acked_through: i64,
    /// Items deleted by this ack.
    pub deleted: u64,
    /// Last seq allocated.
    pub head_seq: i64,
}

/// POST /v2/relay/enc-key request: the v2 record and its signature.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncKeyPost {
    /// The v2 ad record.
    pub ad: Value,
    /// Signature over canonical(ad).
    pub sig: String,
}

/// GET /v2/relay/enc-key response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncKeyAnswer {
    /// Host name.
    pub host: String,
    /// Host key.
    pub host_pubkey: String,
    /// Served enc key (always equals `ad.enc_pub`).
    pub enc_pub: String,
    /// v1 signature, if a v1 ad is held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
    /// The v2 record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ad: Option<Value>,
    /// Signature over canonical(ad).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ad_sig: Option<String>,
}
