//! Counters of refused requests by reason, for `GET /v2/relay/admin/stats` (its `refused`
//! object, [`crate::handlers::admin`]): pushed items refused (`refused.push`) and hops or other
//! requests refused for who sent them (`refused.auth`: every 401, and the 403s of a revoked or
//! deny-listed key). Each reason has a stable snake_case key ([`PushRefusal::key`],
//! [`AuthRefusal::key`]); the set is fixed, so the answer always lists every key (0 when it
//! never happened).
//!
//! The counters belong to the running relay: in memory, from 0 at its start, one relaxed atomic
//! add per refusal and nothing on an accepted item. They are not in the store, so `relay
//! status` (which reads the store offline) cannot show them.
//!
//! Each counted refusal is also logged at DEBUG ([`Refusals::push`], [`Refusals::auth`]) with
//! its reason and at most a key's fingerprint prefix ([`fp_prefix`]): never a key, a
//! signature, a token or a body.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value};

/// Why a pushed item was refused (`rejected:<why>` on the wire, `wire.md` §3.2), one key per
/// rejection string; the store's quota refusals count per quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushRefusal {
    /// `rate`: the sender is over its push rate (every item of the request).
    RateLimit,
    /// `bad item id`.
    BadItemId,
    /// `bad kind`.
    BadKind,
    /// `bad targets`.
    BadTargets,
    /// `target not enrolled` (unknown or revoked target).
    TargetNotEnrolled,
    /// `sender not accepted by target` (the target's sender allowlist).
    SenderNotAccepted,
    /// `duplicate target`.
    DuplicateTarget,
    /// `bad wire`.
    BadWire,
    /// `item over size limit`.
    OverSizeLimit,
    /// `bad envelope: <why>`.
    BadEnvelope,
    /// `item id is not the envelope id`.
    EnvelopeIdMismatch,
    /// `envelope body is not sealed`.
    NotSealed,
    /// `bad receipt`.
    BadReceipt,
    /// `item id is not the receipt id`.
    ReceiptIdMismatch,
    /// `receipt is not signed by the sending host`.
    ReceiptNotSigned,
    /// `conflict`: the same (sender, item id, target) was stored with other bytes.
    Conflict,
    /// `quota:queue depth exceeded for <host>`.
    QuotaQueueDepth,
    /// `quota:queue bytes exceeded for <host>`.
    QuotaQueueBytes,
    /// `quota:sender share exceeded for <host>`.
    QuotaSenderShare,
    /// `quota:owner queue depth exceeded for <host>`.
    QuotaOwnerQueueDepth,
    /// `quota:owner queue bytes exceeded for <host>`.
    QuotaOwnerQueueBytes,
    /// `internal`, or any rejection string not listed above.
    Other,
}

impl PushRefusal {
    /// Every reason, in the order of `wire.md` §3.2's rejection strings.
    pub const ALL: [PushRefusal; 22] = [
        Self::RateLimit,
        Self::BadItemId,
        Self::BadKind,
        Self::BadTargets,
        Self::TargetNotEnrolled,
        Self::SenderNotAccepted,
        Self::DuplicateTarget,
        Self::BadWire,
        Self::OverSizeLimit,
        Self::BadEnvelope,
        Self::EnvelopeIdMismatch,
        Self::NotSealed,
        Self::BadReceipt,
        Self::ReceiptIdMismatch,
        Self::ReceiptNotSigned,
        Self::Conflict,
        Self::QuotaQueueDepth,
        Self::QuotaQueueBytes,
        Self::QuotaSenderShare,
        Self::QuotaOwnerQueueDepth,
        Self::QuotaOwnerQueueBytes,
        Self::Other,
    ];

    /// The stable key in `refused.push`.
    pub fn key(self) -> &'static str {
        match self {
            Self::RateLimit => "rate_limit",
            Self::BadItemId => "bad_item_id",
            Self::BadKind => "bad_kind",
            Self::BadTargets => "bad_targets",
            Self::TargetNotEnrolled => "target_not_enrolled",
            Self::SenderNotAccepted => "sender_not_accepted",
            Self::DuplicateTarget => "duplicate_target",
            Self::BadWire => "bad_wire",
            Self::OverSizeLimit => "over_size_limit",
            Self::BadEnvelope => "bad_envelope",
            Self::EnvelopeIdMismatch => "envelope_id_mismatch",
            Self::NotSealed => "not_sealed",
            Self::BadReceipt => "bad_receipt",
            Self::ReceiptIdMismatch => "receipt_id_mismatch",
            Self::ReceiptNotSigned => "receipt_not_signed",
            Self::Conflict => "conflict",
            Self::QuotaQueueDepth => "quota_queue_depth",
            Self::QuotaQueueBytes => "quota_queue_bytes",
            Self::QuotaSenderShare => "quota_sender_share",
            Self::QuotaOwnerQueueDepth => "quota_owner_queue_depth",
            Self::QuotaOwnerQueueBytes => "quota_owner_queue_bytes",
            Self::Other => "other",
        }
    }

    /// The reason of a rejection string as the push answer carries it after `rejected:`.
    pub fn of_wire(why: &str) -> PushRefusal {
        match why {
            "rate" => Self::RateLimit,
            "bad item id" => Self::BadItemId,
            "bad kind" => Self::BadKind,
            "bad targets" => Self::BadTargets,
            "target not enrolled" => Self::TargetNotEnrolled,
            "sender not accepted by target" => Self::SenderNotAccepted,
            "duplicate target" => Self::DuplicateTarget,
            "bad wire" => Self::BadWire,
            "item over size limit" => Self::OverSizeLimit,
            "item id is not the envelope id" => Self::EnvelopeIdMismatch,
            "envelope body is not sealed" => Self::NotSealed,
            "bad receipt" => Self::BadReceipt,
            "item id is not the receipt id" => Self::ReceiptIdMismatch,
            "receipt is not signed by the sending host" => Self::ReceiptNotSigned,
            "conflict" => Self::Conflict,
            w if w.starts_with("bad envelope:") => Self::BadEnvelope,
            w => match w.strip_prefix("quota:") {
                Some(q) if q.starts_with("queue depth ") => Self::QuotaQueueDepth,
                Some(q) if q.starts_with("queue bytes ") => Self::QuotaQueueBytes,
                Some(q) if q.starts_with("sender share ") => Self::QuotaSenderShare,
                Some(q) if q.starts_with("owner queue depth ") => Self::QuotaOwnerQueueDepth,
                Some(q) if q.starts_with("owner queue bytes ") => Self::QuotaOwnerQueueBytes,
                _ => Self::Other,
            },
        }
    }
}

/// Why a request was refused for who sent it: the hop checks of [`crate::auth`] (every 401 and
/// the 403s of a revoked or deny-listed key), the admin token, enrolment (its 401s and 403s)
/// and the sender list signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthRefusal {
    /// 401 `BAD_HOP`: `x-mbx-key`, `x-mbx-ts` or `x-mbx-sig` missing (or not text).
    MissingHeader,
    /// 401 `BAD_HOP`: `x-mbx-ts` is not plain decimal digits.
    BadTimestamp,
    /// 401 `BAD_HOP`: `x-mbx-key` is not an Ed25519 key.
    BadKey,
    /// 401 `BAD_HOP`: `x-mbx-ts` more than 300,000 ms from the relay's clock.
    StaleTimestamp,
    /// 401 `BAD_HOP`: the signature does not verify with the key.
    BadSignature,
    /// 401 `NOT_ENROLLED`: the key is not enrolled.
    NotEnrolled,
    /// 403 `REVOKED`.
    Revoked,
    /// 403 `DENIED`: the key's fingerprint or the token's client is deny-listed.
    Denied,
    /// 401 `TOKEN_REQUIRED`: an account relay's hop without `Authorization`.
    TokenRequired,
    /// 401 `BAD_TOKEN`: the account token is malformed, refused, or for another key, client
    /// or account.
    BadToken,
    /// 401 `NOT_ENROLLED`: on an account relay, the key was enrolled without an account token.
    NoAccountBinding,
    /// 401 `ADMIN_TOKEN`: an admin route without the admin token (or with another one).
    AdminToken,
    /// 401 `NO_CHALLENGE`: an enrolment without a pending challenge.
    NoChallenge,
    /// 403 `DENIED`: the enrolment authority refused the enrolment (e.g. an account token that
    /// does not verify).
    AuthorityDenied,
    /// 401 `BAD_SIGNATURE`: an enrolment whose signature does not verify.
    BadEnrolSignature,
    /// 401 `BAD_SIGNATURE`: a sender list not signed by the target.
    BadListSignature,
    /// 401 `BAD_NONCE`: a push stream upgrade whose nonce is missing, unknown, used, expired or
    /// another key's (`docs/relay-stream.md`).
    BadNonce,
}

impl AuthRefusal {
    /// Every reason.
    pub const ALL: [AuthRefusal; 17] = [
        Self::MissingHeader,
        Self::BadTimestamp,
        Self::BadKey,
        Self::StaleTimestamp,
        Self::BadSignature,
        Self::NotEnrolled,
        Self::Revoked,
        Self::Denied,
        Self::TokenRequired,
        Self::BadToken,
        Self::NoAccountBinding,
        Self::AdminToken,
        Self::NoChallenge,
        Self::AuthorityDenied,
        Self::BadEnrolSignature,
        Self::BadListSignature,
        Self::BadNonce,
    ];

    /// The stable key in `refused.auth`.
    pub fn key(self) -> &'static str {
        match self {
            Self::MissingHeader => "missing_header",
            Self::BadTimestamp => "bad_timestamp",
            Self::BadKey => "bad_key",
            Self::StaleTimestamp => "stale_timestamp",
            Self::BadSignature => "bad_signature",
            Self::NotEnrolled => "not_enrolled",
            Self::Revoked => "revoked",
            Self::Denied => "denied",
            Self::TokenRequired => "token_required",
            Self::BadToken => "bad_token",
            Self::NoAccountBinding => "no_account_binding",
            Self::AdminToken => "admin_token",
            Self::NoChallenge => "no_challenge",
            Self::AuthorityDenied => "authority_denied",
            Self::BadEnrolSignature => "bad_enrol_signature",
            Self::BadListSignature => "bad_list_signature",
            Self::BadNonce => "bad_nonce",
        }
    }
}

/// The first two groups of a key fingerprint (`abcd-ef01` of `abcd-ef01-2345-6789`): enough to
/// tell hosts apart in a log, never the key.
pub fn fp_prefix(fingerprint: &str) -> &str {
    fingerprint.get(..9).unwrap_or(fingerprint)
}

/// The running relay's refusal counters (module docs).
#[derive(Debug, Default)]
pub struct Refusals {
    push: [AtomicU64; PushRefusal::ALL.len()],
    auth: [AtomicU64; AuthRefusal::ALL.len()],
}

impl Refusals {
    /// Counts one refused item of a push by the host whose fingerprint starts `sender_fp` and
    /// logs it at DEBUG (item id, the wire reason; no key material).
    pub fn push(&self, why: &str, item_id: &str, sender_fp: &str) {
        let reason = PushRefusal::of_wire(why);
        self.push[reason as usize].fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            reason = reason.key(),
            sender = fp_prefix(sender_fp),
            item_id,
            rejected = why,
            "push item refused"
        );
    }

    /// Counts one request refused for `reason` and logs it at DEBUG: the request's method and
    /// path (no query), and the caller's fingerprint prefix when its key parsed.
    pub fn auth(&self, reason: AuthRefusal, method: &str, path: &str, key_fp: Option<&str>) {
        self.auth[reason as usize].fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            reason = reason.key(),
            method,
            path,
            key = key_fp.map(fp_prefix).unwrap_or("-"),
            "caller refused"
        );
    }

    /// How many items were refused for `reason` since the relay started.
    pub fn pushes(&self, reason: PushRefusal) -> u64 {
        self.push[reason as usize].load(Ordering::Relaxed)
    }

    /// How many requests were refused for `reason` since the relay started.
    pub fn auths(&self, reason: AuthRefusal) -> u64 {
        self.auth[reason as usize].load(Ordering::Relaxed)
    }

    /// `{push: {<key>: n, …}, auth: {<key>: n, …}}` with every key of both sets.
    pub fn to_json(&self) -> Value {
        let push: Map<String, Value> = PushRefusal::ALL
            .iter()
            .map(|r| (r.key().to_owned(), Value::from(self.pushes(*r))))
            .collect();
        let auth: Map<String, Value> = AuthRefusal::ALL
            .iter()
            .map(|r| (r.key().to_owned(), Value::from(self.auths(*r))))
            .collect();
        serde_json::json!({"push": push, "auth": auth})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_index_and_key() {
        for (i, r) in PushRefusal::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
        }
        for (i, r) in AuthRefusal::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
        }
        let keys: std::collections::HashSet<&str> =
            PushRefusal::ALL.iter().map(|r| r.key()).collect();
        assert_eq!(keys.len(), PushRefusal::ALL.len());
        let keys: std::collections::HashSet<&str> =
            AuthRefusal::ALL.iter().map(|r| r.key()).collect();
        assert_eq!(keys.len(), AuthRefusal::ALL.len());
    }

    #[test]
    fn wire_rejection_strings_map_to_their_reason() {
        use crate::store::{QuotaKind, Rejection};
        for (why, reason) in [
            ("rate", PushRefusal::RateLimit),
            ("bad envelope: missing from", PushRefusal::BadEnvelope),
            ("internal", PushRefusal::Other),
            ("something new", PushRefusal::Other),
        ] {
            assert_eq!(PushRefusal::of_wire(why), reason, "{why}");
        }
        // Every store rejection, as the answer spells it.
        for (rejection, reason) in [
            (Rejection::BadTargets, PushRefusal::BadTargets),
            (Rejection::TargetNotEnrolled, PushRefusal::TargetNotEnrolled),
            (Rejection::SenderNotAccepted, PushRefusal::SenderNotAccepted),
            (Rejection::DuplicateTarget, PushRefusal::DuplicateTarget),
            (Rejection::Conflict, PushRefusal::Conflict),
        ] {
            assert_eq!(PushRefusal::of_wire(&rejection.code()), reason);
        }
        for (kind, reason) in [
            (QuotaKind::QueueDepth, PushRefusal::QuotaQueueDepth),
            (QuotaKind::QueueBytes, PushRefusal::QuotaQueueBytes),
            (QuotaKind::SenderShare, PushRefusal::QuotaSenderShare),
            (
                QuotaKind::OwnerQueueDepth,
                PushRefusal::QuotaOwnerQueueDepth,
            ),
            (
                QuotaKind::OwnerQueueBytes,
                PushRefusal::QuotaOwnerQueueBytes,
            ),
        ] {
            let r = Rejection::Quota {
                kind,
                host: "queue depth host".into(),
            };
            assert_eq!(PushRefusal::of_wire(&r.code()), reason);
        }
        // Each key of the wire list maps to itself.
        for r in PushRefusal::ALL {
            if matches!(r, PushRefusal::Other) || r.key().starts_with("quota_") {
                continue;
            }
            let why = match r {
                PushRefusal::RateLimit => "rate",
                PushRefusal::BadItemId => "bad item id",
                PushRefusal::BadKind => "bad kind",
                PushRefusal::BadTargets => "bad targets",
                PushRefusal::TargetNotEnrolled => "target not enrolled",
                PushRefusal::SenderNotAccepted => "sender not accepted by target",
                PushRefusal::DuplicateTarget => "duplicate target",
                PushRefusal::BadWire => "bad wire",
                PushRefusal::OverSizeLimit => "item over size limit",
                PushRefusal::BadEnvelope => "bad envelope: x",
                PushRefusal::EnvelopeIdMismatch => "item id is not the envelope id",
                PushRefusal::NotSealed => "envelope body is not sealed",
                PushRefusal::BadReceipt => "bad receipt",
                PushRefusal::ReceiptIdMismatch => "item id is not the receipt id",
                PushRefusal::ReceiptNotSigned => "receipt is not signed by the sending host",
                _ => "conflict",
            };
            assert_eq!(PushRefusal::of_wire(why), r, "{why}");
        }
    }

    #[test]
    fn counts_by_reason_and_lists_every_key() {
        let r = Refusals::default();
        r.push(
            "quota:queue depth exceeded for beta",
            "i1",
            "abcd-ef01-2345-6789",
        );
        r.push(
            "quota:queue depth exceeded for beta",
            "i2",
            "abcd-ef01-2345-6789",
        );
        r.auth(AuthRefusal::StaleTimestamp, "GET", "/v2/relay/items", None);
        let j = r.to_json();
        assert_eq!(j["push"]["quota_queue_depth"], 2);
        assert_eq!(j["push"]["conflict"], 0);
        assert_eq!(j["auth"]["stale_timestamp"], 1);
        assert_eq!(j["push"].as_object().unwrap().len(), PushRefusal::ALL.len());
        assert_eq!(j["auth"].as_object().unwrap().len(), AuthRefusal::ALL.len());
        assert_eq!(fp_prefix("abcd-ef01-2345-6789"), "abcd-ef01");
        assert_eq!(fp_prefix("ab"), "ab");
    }
}
