//! The directory: the [`DirectoryStore`] trait and its types — enrolments, enc-key ads, sender
//! allowlists, host rotation, the deny list and account bindings (spec §2, §8). Backend-neutral:
//! no SQL here.

use super::operations::OpEntry;
use super::StoreError;

/// Strength of the enrolment authority that admitted a host (spec §2, §8). A weaker authority
/// never overwrites the `account`/`authorized_by` a stronger one recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum AuthorityStrength {
    /// The default self-hosted authority: the host proved only that it holds its key.
    HostKeyChallenge,
    /// An authority that proved an account (hosted relay: account-issued, host-bound tokens).
    Account,
}

impl AuthorityStrength {
    /// The rank stored in `enrolments.authority_rank`; higher is stronger.
    pub fn rank(self) -> i64 {
        match self {
            Self::HostKeyChallenge => 0,
            Self::Account => 10,
        }
    }

    /// The strength for a stored rank, `None` for a rank this binary does not know.
    pub fn from_rank(rank: i64) -> Option<Self> {
        match rank {
            0 => Some(Self::HostKeyChallenge),
            10 => Some(Self::Account),
            _ => None,
        }
    }
}

/// An enrolment request, already authorised by the handler's `EnrolmentAuthority` (spec §8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnrolRequest {
    /// The host key (standard base64 of the 32-byte Ed25519 key).
    pub host_pubkey: String,
    /// The host's name, a label (matched case-insensitively).
    pub host_name: String,
    /// The host's own unproven owner claim ("" when none); decides nothing.
    pub owner_fp: String,
    /// The account the authority proved, if any. Names are unique per account.
    pub account: Option<String>,
    /// Which authority admitted the host (e.g. `host-key-challenge`).
    pub authorized_by: String,
    /// How strong that authority is.
    pub strength: AuthorityStrength,
    /// Now, in ms.
    pub now_ms: i64,
}

/// A stored enrolment (`enrolments` row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolment {
    /// The host key.
    pub host_pubkey: String,
    /// The host's name as last enrolled.
    pub host_name: String,
    /// The host's unproven owner claim.
    pub owner_fp: String,
    /// The proven account, if any.
    pub account: Option<String>,
    /// The authority that recorded `account`.
    pub authorized_by: String,
    /// That authority's strength.
    pub strength: AuthorityStrength,
    /// When the key last (re-)enrolled, in ms.
    pub enrolled_at_ms: i64,
    /// When the key was revoked, in ms; `None` while live.
    pub revoked_at_ms: Option<i64>,
}

impl Enrolment {
    /// Whether the key is revoked (revoked keys stay revoked, spec §2).
    pub fn is_revoked(&self) -> bool {
        self.revoked_at_ms.is_some()
    }
}

/// The result of [`DirectoryStore::enrol`] (`wire.md` §3.1 enrol errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnrolOutcome {
    /// Enrolled or refreshed; the stored row after the write.
    Enrolled(Enrolment),
    /// The key is revoked on this relay and stays revoked (403 REVOKED).
    Revoked,
    /// Another live key carries this name (case-insensitively) in the same proven account
    /// (409 NAME_TAKEN).
    NameTaken,
    /// The live-enrolment cap is reached and the key is new (503 FULL).
    Full,
    /// The account binding names a cloud key already bound to another live host key (409
    /// CLOUD_KEY_TAKEN; [`DirectoryStore::enrol_bound`]).
    CloudKeyTaken,
}

/// The result of [`DirectoryStore::revoke`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevokeOutcome {
    /// The key was live and is now revoked.
    Revoked,
    /// The key was already revoked; its original `revoked_at` is kept.
    AlreadyRevoked,
    /// The key was never enrolled here; nothing was written.
    Unknown,
}

/// A v1 enc-key advertisement (`wire.md` §2.8): `sig` is the host key's signature over
/// canonical(`{v:1, host, enc_pub}`), stored in `enc_ads`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncAdV1 {
    /// The advertising host's key.
    pub host_pubkey: String,
    /// The host name the signature covers.
    pub host_name: String,
    /// The X25519 public key (base64).
    pub enc_pub: String,
    /// The v1 signature.
    pub sig: String,
    /// When the relay stored it, in ms.
    pub at_ms: i64,
}

/// A v2 enc-key advertisement (`wire.md` §2.8, T168), stored in `enc_ad_records`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncAdV2 {
    /// The advertising host's key.
    pub host_pubkey: String,
    /// The `enc_pub` inside the record (the handler extracted it after verifying the record).
    pub enc_pub: String,
    /// The record as received, canonical JSON text; served back byte for byte.
    pub record: String,
    /// The host key's signature over `record`.
    pub sig: String,
    /// When the relay stored it, in ms.
    pub at_ms: i64,
}

/// What the relay serves for a host's enc key (`wire.md` §2.8, "Resolved details" enc-key
/// endpoints): the v2 record when there is one, the v1 ad when it names the same key (or there is
/// no v2 record). `enc_pub` always equals the v2 record's `enc_pub` when a record is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncAd {
    /// The host key.
    pub host_pubkey: String,
    /// The host's enrolled name.
    pub host_name: String,
    /// The key served.
    pub enc_pub: String,
    /// The v1 advertisement, if served.
    pub v1: Option<EncAdV1>,
    /// The v2 record, if any.
    pub v2: Option<EncAdV2>,
}

/// A target's signed sender allowlist (spec §2 "Sender allowlist", `wire.md` §2.12), verified by
/// the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SenderList {
    /// The target host key that signed it.
    pub target_pubkey: String,
    /// The sender keys it accepts (duplicates are dropped on store, order kept).
    pub senders: Vec<String>,
    /// The list's `iat`, in ms (the handler parses the ISO text).
    pub iat_ms: i64,
    /// The signed record, canonical JSON text.
    pub record: String,
    /// The target's signature over `record`.
    pub sig: String,
}

/// The result of [`DirectoryStore::put_sender_list`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SenderListOutcome {
    /// Stored; it replaces any older list.
    Stored,
    /// A list with the same or a newer `iat` is stored; nothing changed (409 STALE).
    Stale,
}

/// A host rotation whose record the handler verified (spec §2 "Rotation"; `wire.md` §2.10,
/// §3.2): both keys signed it and it starts from `old_pubkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RotateRequest {
    /// The retired host key (canonical text).
    pub old_pubkey: String,
    /// The new host key (canonical text).
    pub new_pubkey: String,
    /// The record's `host`; must be the old enrolment's name (case-insensitively).
    pub host_name: String,
    /// Now, in ms: the revocation time and the seq floor of the moved items.
    pub now_ms: i64,
}

/// The result of [`DirectoryStore::rotate`] (`wire.md` §3.1 rotate errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotateOutcome {
    /// Applied: `moved` queued items now wait for the new key.
    Rotated {
        /// Items moved to the new key's queue.
        moved: u64,
    },
    /// This very rotation (old → new) was applied before: nothing changed (answered like a
    /// success, so a host repeating it stops).
    AlreadyRotated,
    /// The old key is unknown here, or revoked other than by a rotation to this new key
    /// (404 NOT_ENROLLED).
    NotEnrolled,
    /// The record names another host than the old enrolment (400 BAD_ROTATION).
    OtherHost,
    /// The new key is revoked on this relay (409 ROTATION_TARGET).
    TargetRevoked,
    /// The account the new key would carry already has another live host of this name
    /// (409 ROTATION_TARGET).
    TargetNameTaken,
}

// ---- Deny-list and account bindings (spec §8 "Revocation"; authority/) ----------------------

/// Most deny-list entries a store keeps (expired ones are pruned first): an operator list, but
/// every table is bounded.
pub const MAX_DENY_ENTRIES: u64 = 100_000;

/// What a deny-list entry is keyed by (spec §8: "keyed by host_fp and client_id").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DenyKind {
    /// A host key's fingerprint `xxxx-xxxx-xxxx-xxxx` (`wire.md` §2.1).
    Host,
    /// An account token's `client_id` claim.
    Client,
}

impl DenyKind {
    /// The text stored in `deny.kind` and shown to operators: `host` or `client`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Client => "client",
        }
    }

    /// The kind for its text, `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "host" => Some(Self::Host),
            "client" => Some(Self::Client),
            _ => None,
        }
    }
}

/// One deny-list entry (`deny` row). A denied host's next request is refused (403 DENIED) at
/// enrolment and on every hop while the entry is active.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyEntry {
    /// What `value` names.
    pub kind: DenyKind,
    /// The host fingerprint or the client_id (at most 256 bytes).
    pub value: String,
    /// End of the entry in ms; `None` denies until removed.
    pub until_ms: Option<i64>,
    /// When it was (last) written, in ms.
    pub at_ms: i64,
}

impl DenyEntry {
    /// Whether the entry still denies at `now_ms` (no `until`, or `until` later than now).
    pub fn is_active(&self, now_ms: i64) -> bool {
        self.until_ms.is_none_or(|u| u > now_ms)
    }
}

/// The result of [`DirectoryStore::deny`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DenyOutcome {
    /// Written (a new entry, or a replaced one: the stored row after the write).
    Stored(DenyEntry),
    /// [`MAX_DENY_ENTRIES`] active entries exist and this one is new; nothing was written.
    Full,
}

/// What the account authority proved about an enrolled host (spec §8), recorded in
/// `account_bindings` in the enrolment's own transaction: every later hop's token must be bound
/// to the same cloud key (`cnf.jkt == cloud_jkt`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountBinding {
    /// The enrolled host key.
    pub host_pubkey: String,
    /// RFC 7638 thumbprint of the host's certified cloud key.
    pub cloud_jkt: String,
    /// The token's `client_id` (deny-list key).
    pub client_id: String,
    /// The token's `sub` (the host id at the issuer).
    pub sub: String,
    /// The token's `org`, if any.
    pub org: Option<String>,
    /// When it was recorded, in ms.
    pub at_ms: i64,
}

/// Live enrolments one name may carry before it is crowded (spec §2: "more than 16"; 0.5.x
/// `maxPerName`). The name lookup (`crate::handlers::enc_key`) refuses to resolve a crowded name.
pub const MAX_PER_NAME: usize = 16;

/// Most rows [`DirectoryStore::live_enrolments_by_name`] returns: the crowded threshold (a name
/// carried by more than [`MAX_PER_NAME`] live enrolments, spec §2) plus one, enough to tell a
/// crowded name.
pub const MAX_LIVE_BY_NAME: usize = 17;

const _: () = assert!(MAX_LIVE_BY_NAME == MAX_PER_NAME + 1);

/// Who may send and receive (spec §2, §8): enrolments and revocation, enc-key advertisements,
/// sender allowlists, host rotation, the deny list and account bindings. Blocking, like every
/// store trait (see [`RelayStore`](crate::store::RelayStore)).
pub trait DirectoryStore: Send + Sync + std::fmt::Debug {
    /// Enrol or re-enrol a host key (spec §2 enrolments, §8). A revoked key stays revoked; a
    /// weaker authority never overwrites the account or `authorized_by` a stronger one recorded;
    /// a name is unique only inside a proven account (case-insensitive); a new key is refused at
    /// the live cap.
    fn enrol(&self, req: EnrolRequest) -> Result<EnrolOutcome, StoreError>;

    /// The enrolment of a key, live or revoked.
    fn enrolment(&self, host_pubkey: &str) -> Result<Option<Enrolment>, StoreError>;

    /// Live enrolments carrying a name (case-insensitive), newest first, at most
    /// [`MAX_LIVE_BY_NAME`] of them (v1 name lookups, spec §2): a lookup only needs to know
    /// whether the name is crowded, so a crowded name never loads all its carriers.
    fn live_enrolments_by_name(&self, host_name: &str) -> Result<Vec<Enrolment>, StoreError>;

    /// How many enrolments are live.
    fn live_enrolment_count(&self) -> Result<u64, StoreError>;

    /// Revoke a key for good (it serves nothing and receives nothing afterwards).
    fn revoke(&self, host_pubkey: &str, now_ms: i64) -> Result<RevokeOutcome, StoreError>;

    /// Store a verified v1 enc-key advertisement (replaces the previous one).
    fn put_enc_ad_v1(&self, ad: EncAdV1) -> Result<(), StoreError>;

    /// Store a verified v2 enc-key record (replaces the previous one).
    fn put_enc_ad_v2(&self, ad: EncAdV2) -> Result<(), StoreError>;

    /// The enc key to serve for a host; `None` when the host is unknown, revoked or has no ad.
    fn get_enc_ad(&self, host_pubkey: &str) -> Result<Option<EncAd>, StoreError>;

    /// Store a verified sender allowlist unless one with the same or a newer `iat` is stored.
    fn put_sender_list(&self, list: SenderList) -> Result<SenderListOutcome, StoreError>;

    /// A target's stored sender allowlist.
    fn sender_list(&self, target_pubkey: &str) -> Result<Option<SenderList>, StoreError>;

    /// Apply a verified host rotation in one transaction (spec §2 "Rotation"): the new key
    /// takes the old enrolment's name, account, `authorized_by` and owner claim (a stronger
    /// authority the new key already has keeps its account); the old key's queued items move
    /// to the new key in order, re-sequenced after the new key's own; the old key's enc-key ads
    /// are dropped; its allowlist becomes the new key's (unless the new key published its own)
    /// and it is replaced by the new key in every other target's allowlist; the old key is
    /// revoked; the old key's active host deny-list entries are copied to the new key's
    /// fingerprint. Moved items are not charged to quotas (they may take the new key past
    /// them). Refusals change nothing. Dedup rows stay under the old key, so a retry naming
    /// the old key still settles as `duplicate`.
    fn rotate(&self, req: RotateRequest) -> Result<RotateOutcome, StoreError>;

    // ---- Deny-list and account bindings (spec §8; authority/) ----

    /// [`DirectoryStore::enrol`], and when it enrols (outcome `Enrolled`) and `binding` is given,
    /// records the account binding for the key in the same transaction (replacing an older
    /// one). A binding whose `cloud_jkt` is already bound to another live (not revoked) host key
    /// is refused with [`EnrolOutcome::CloudKeyTaken`]. A refused enrolment writes nothing.
    fn enrol_bound(
        &self,
        req: EnrolRequest,
        binding: Option<AccountBinding>,
    ) -> Result<EnrolOutcome, StoreError>;

    /// The account binding recorded for a key, if any.
    fn account_binding(&self, host_pubkey: &str) -> Result<Option<AccountBinding>, StoreError>;

    /// Adds or replaces a deny-list entry (expired entries are pruned in the same transaction).
    /// [`DenyOutcome::Full`] when [`MAX_DENY_ENTRIES`] are stored and the entry is new.
    fn deny(&self, entry: DenyEntry) -> Result<DenyOutcome, StoreError>;

    /// Removes a deny-list entry; `false` when there was none.
    fn undeny(&self, kind: DenyKind, value: &str) -> Result<bool, StoreError>;

    /// [`DirectoryStore::revoke`], and when it revokes ([`RevokeOutcome::Revoked`]) appends `log`
    /// to the relay log in the same transaction.
    fn revoke_logged(
        &self,
        host_pubkey: &str,
        now_ms: i64,
        log: OpEntry,
    ) -> Result<RevokeOutcome, StoreError>;

    /// [`DirectoryStore::deny`], and when it stores the entry appends `log` to the relay log in the
    /// same transaction.
    fn deny_logged(&self, entry: DenyEntry, log: OpEntry) -> Result<DenyOutcome, StoreError>;

    /// [`DirectoryStore::undeny`], and when it removed an entry appends `log` to the relay log in
    /// the same transaction.
    fn undeny_logged(&self, kind: DenyKind, value: &str, log: OpEntry) -> Result<bool, StoreError>;

    /// Every stored deny-list entry (active or expired but not yet pruned), ordered by kind
    /// then value.
    fn deny_entries(&self) -> Result<Vec<DenyEntry>, StoreError>;

    /// The active entry that denies a host with fingerprint `host_fp` (and, when known, token
    /// `client_id`) at `now_ms`, if any; a host entry is reported before a client entry.
    fn denied(
        &self,
        host_fp: &str,
        client_id: Option<&str>,
        now_ms: i64,
    ) -> Result<Option<DenyEntry>, StoreError>;

    /// Every enrolment (live or revoked) whose key has the fingerprint `fp`
    /// (`xxxx-xxxx-xxxx-xxxx`), for `relay revoke <fingerprint>`. Scans all enrolments: an
    /// operator command, not a request path.
    fn enrolments_by_fingerprint(&self, fp: &str) -> Result<Vec<Enrolment>, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authority_ranks_round_trip_and_order() {
        for s in [
            AuthorityStrength::HostKeyChallenge,
            AuthorityStrength::Account,
        ] {
            assert_eq!(AuthorityStrength::from_rank(s.rank()), Some(s));
        }
        assert!(AuthorityStrength::HostKeyChallenge < AuthorityStrength::Account);
        assert_eq!(AuthorityStrength::from_rank(7), None);
    }
}
