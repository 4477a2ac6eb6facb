//! The store backend conformance suite: every store rule of spec §2–§7 checked through the
//! [`RelayStore`] trait and the types of [`crate::store`] only (and, for backup and restore,
//! the operator entry points over the backend's [`StoreMaintenance`]), so any backend can be
//! held to the rules SQLite keeps.
//!
//! # What it owns
//! One public function per rule, each taking a [`Factory`] that opens a fresh, empty store, or
//! for backup and restore a [`Backend`] that opens the store kept in a directory (and being
//! able to fail on its own: a rule checks one thing and says which). The rules:
//! - items (spec §2–§4, §7; `items.rs`): dedup, the seq floor, all-or-nothing over targets,
//!   quotas, pull pages, ack positions, wire bytes kept byte for byte;
//! - directory (spec §2, §8; `directory.rs`): enrolments and names, revocation sticks, enc-key
//!   ads, sender lists, rotation, the deny list, account bindings;
//! - operations (spec §5–§6; `operations.rs`): retention, tombstones and expiry notices, the
//!   dedup horizon, epoch and heartbeat, meta, the relay log;
//! - backup and restore (spec §5; `restore.rs`, [`BackendRule`]s): the export/import round
//!   trip (everything reads back the same under a new epoch, seqs never go back) and the
//!   carry-forward of what the replaced store did after the backup (revocations stick, deny
//!   entries stay active, rotations stay applied, the seq floor stays above every seq handed
//!   out), through [`ops::backup_with`](crate::ops::backup_with) and
//!   [`ops::restore_with`](crate::ops::restore_with).
//!
//! # How a backend runs it
//! [`conformance_tests!`](crate::conformance_tests) expands to one `#[test]` per rule, so each
//! rule is its own named test:
//!
//! ```ignore
//! fn sqlite(setup: &Setup) -> Opened { /* open a fresh store for setup */ }
//! fn sqlite_in(dir: &Path, setup: &Setup) -> Arc<dyn RelayStore> { /* open the store in dir */ }
//! const SQLITE: Backend = Backend { open: sqlite_in, maintenance: &SqliteMaintenance };
//! agentmbx_relay::conformance_tests!(sqlite, SQLITE);
//! ```
//!
//! [`run_all`] runs them all in one call instead.
//!
//! # What it must never do
//! Look past the traits (no SQL, no files): what a rule cannot see through [`RelayStore`] (or
//! do through the backup and restore entry points), it does not check.

mod directory;
mod items;
mod operations;
mod restore;

pub use directory::*;
pub use items::*;
pub use operations::*;
pub use restore::*;

use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;

use crate::store::{
    AckRequest, AckResult, AuthorityStrength, EnrolOutcome, EnrolRequest, Expiry, ExpiryFacts,
    HostQueueInfo, ItemOutcome, NoticeSigner, PullPage, PullRequest, PushBatch, PushItem,
    PushOutcome, PushTarget, RelayStore, StoreLimits, StoreMaintenance, SweepReport,
};

/// Where every rule's clock starts (Unix ms): [`super::T0`].
pub const T0: i64 = super::T0;

/// One day in ms.
pub const DAY: i64 = crate::store::DAY_MS;

/// What a rule asks its [`Factory`] for: a fresh, empty store bound to `relay_pubkey`, opened
/// at `now_ms`, enforcing `limits`.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The relay public key the store is bound to (canonical standard base64).
    pub relay_pubkey: String,
    /// Now, at open (Unix ms).
    pub now_ms: i64,
    /// Quotas and retention.
    pub limits: StoreLimits,
}

/// A store a [`Factory`] opened, with whatever must live as long as it (a temporary
/// directory, a database container).
pub struct Opened {
    /// The store under test.
    pub store: Arc<dyn RelayStore>,
    /// Kept alive until the rule ends, then dropped after the store.
    pub keep: Box<dyn std::any::Any>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// Opens a fresh, empty store for a [`Setup`]. It may panic when it cannot.
pub type Factory = dyn Fn(&Setup) -> Opened;

/// What the backup and restore rules ask of a backend beyond a [`Factory`]: its store kept in
/// a directory the rule chooses (and reopened there after a restore), and its file-level
/// operations, which [`ops::backup_with`](crate::ops::backup_with) and
/// [`ops::restore_with`](crate::ops::restore_with) run through.
#[derive(Clone, Copy)]
pub struct Backend {
    /// Opens the store in `dir` for a [`Setup`], creating it when `dir` holds none. It is
    /// closed (and `dir` free for a restore) once the last handle drops. It may panic.
    pub open: fn(&Path, &Setup) -> Arc<dyn RelayStore>,
    /// The backend's file-level operations (backup, restore).
    pub maintenance: &'static dyn StoreMaintenance,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").finish_non_exhaustive()
    }
}

/// A canonical host key for `n` (standard base64 of 32 bytes `n`).
pub fn key(n: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([n; 32])
}

/// The relay key of every rule's store.
pub fn relay_key() -> String {
    key(200)
}

/// A store opened for a rule, and the helpers the rules share.
pub(crate) struct Store {
    pub(crate) s: Arc<dyn RelayStore>,
    _keep: Box<dyn std::any::Any>,
}

impl Store {
    /// A fresh store with the default limits.
    pub(crate) fn open(make: &Factory) -> Store {
        Store::open_limited(make, StoreLimits::default())
    }

    /// A fresh store with `limits`.
    pub(crate) fn open_limited(make: &Factory, limits: StoreLimits) -> Store {
        let opened = make(&Setup {
            relay_pubkey: relay_key(),
            now_ms: T0,
            limits,
        });
        Store {
            s: opened.store,
            _keep: opened.keep,
        }
    }

    /// Enrols `alpha` ([`key`] 1) and `beta` (key 2) with the host-key challenge, the sender
    /// and target most rules need; returns their keys.
    pub(crate) fn alpha_and_beta(&self) -> (String, String) {
        let (alpha, beta) = (key(1), key(2));
        self.enrol(&alpha, "alpha");
        self.enrol(&beta, "beta");
        (alpha, beta)
    }

    /// Enrols `k` as `name` with the host-key challenge; asserts it enrolled.
    pub(crate) fn enrol(&self, k: &str, name: &str) {
        let out = self.enrol_as(k, name, None);
        assert!(matches!(out, EnrolOutcome::Enrolled(_)), "{out:?}");
    }

    /// Enrols `k` as `name`, in `account` (proven by the account authority) when given.
    pub(crate) fn enrol_as(&self, k: &str, name: &str, account: Option<&str>) -> EnrolOutcome {
        self.s
            .enrol(enrol_request(k, name, account))
            .expect("enrol")
    }

    /// Pushes `items` from `sender` at `now_ms` (expiring after retention).
    pub(crate) fn push(&self, sender: &str, now_ms: i64, items: Vec<PushItem>) -> PushOutcome {
        self.push_expiring(sender, now_ms, Expiry::Retention, items)
    }

    /// [`Store::push`] with the given expiry.
    pub(crate) fn push_expiring(
        &self,
        sender: &str,
        now_ms: i64,
        expiry: Expiry,
        items: Vec<PushItem>,
    ) -> PushOutcome {
        let n = items.len();
        let out = self
            .s
            .push(batch(sender, "sender", now_ms, expiry, items))
            .expect("push");
        assert_eq!(out.items.len(), n, "one outcome per item: {out:?}");
        out
    }

    /// Pushes one item and returns its outcome.
    pub(crate) fn push_one(&self, sender: &str, now_ms: i64, it: PushItem) -> ItemOutcome {
        self.push(sender, now_ms, vec![it]).items.remove(0)
    }

    /// Every item queued for `target` (one page as large as the store allows).
    pub(crate) fn pull_all(&self, target: &str) -> PullPage {
        self.s.pull(pull_everything(target)).expect("pull")
    }

    /// One page of `target`'s queue.
    pub(crate) fn pull(&self, target: &str, after: i64, limit: i64, max_bytes: u64) -> PullPage {
        self.s
            .pull(pull_request(target, after, limit, max_bytes))
            .expect("pull")
    }

    /// The seqs of `target`'s queue, in order.
    pub(crate) fn queued_seqs(&self, target: &str) -> Vec<i64> {
        self.pull_all(target).items.iter().map(|i| i.seq).collect()
    }

    /// The item ids of `target`'s queue, in order.
    pub(crate) fn queued_ids(&self, target: &str) -> Vec<String> {
        self.pull_all(target)
            .items
            .into_iter()
            .map(|i| i.item_id)
            .collect()
    }

    /// Acks `target`'s queue through `through`, in `epoch` when given.
    pub(crate) fn ack(&self, target: &str, through: i64, epoch: Option<&str>) -> AckResult {
        self.s
            .ack(AckRequest {
                target_pubkey: target.to_owned(),
                through,
                epoch: epoch.map(str::to_owned),
            })
            .expect("ack")
    }

    /// `target`'s queue head and ack position.
    pub(crate) fn info(&self, target: &str) -> HostQueueInfo {
        self.s.info_for(target).expect("info")
    }

    /// The current epoch.
    pub(crate) fn epoch(&self) -> String {
        self.s.epoch().expect("epoch")
    }

    /// One retention sweep at `now_ms`, notices signed by a [`FakeNoticeSigner`].
    pub(crate) fn sweep(&self, now_ms: i64) -> SweepReport {
        self.s
            .sweep(now_ms, Arc::new(FakeNoticeSigner(relay_key())))
            .expect("sweep")
    }
}

/// An enrolment request for `k` named `name` at [`T0`]; in `account` (account authority) when
/// given, else by the host-key challenge.
pub(crate) fn enrol_request(k: &str, name: &str, account: Option<&str>) -> EnrolRequest {
    let (authorized_by, strength) = match account {
        Some(_) => ("account-token", AuthorityStrength::Account),
        None => ("host-key-challenge", AuthorityStrength::HostKeyChallenge),
    };
    EnrolRequest {
        host_pubkey: k.to_owned(),
        host_name: name.to_owned(),
        owner_fp: String::new(),
        account: account.map(str::to_owned),
        authorized_by: authorized_by.to_owned(),
        strength,
        now_ms: T0,
    }
}

/// The enrolment request of `enrol_request` at `now_ms` (milliseconds since the epoch) instead
/// of [`T0`].
pub fn enrol_request_at(k: &str, name: &str, account: Option<&str>, now_ms: i64) -> EnrolRequest {
    EnrolRequest {
        now_ms,
        ..enrol_request(k, name, account)
    }
}

/// A pull of one page of `target`'s queue: items after seq `after`, at most `limit` of them
/// and `max_bytes` of wire.
pub(crate) fn pull_request(target: &str, after: i64, limit: i64, max_bytes: u64) -> PullRequest {
    PullRequest {
        target_pubkey: target.to_owned(),
        after,
        limit,
        max_bytes,
    }
}

/// A pull of all of `target`'s queue (one page as large as the store allows).
pub(crate) fn pull_everything(target: &str) -> PullRequest {
    pull_request(target, 0, crate::store::MAX_PULL_ITEMS, u64::MAX)
}

/// The values of `store`'s deny entries, in its order.
pub fn deny_values(store: &dyn crate::store::DirectoryStore) -> Vec<String> {
    store
        .deny_entries()
        .expect("list")
        .into_iter()
        .map(|e| e.value)
        .collect()
}

/// A push of `items` from `sender` (host `sender_host`) at `now_ms` under `expiry`.
pub fn batch(
    sender: &str,
    sender_host: &str,
    now_ms: i64,
    expiry: Expiry,
    items: Vec<PushItem>,
) -> PushBatch {
    PushBatch {
        sender_pubkey: sender.to_owned(),
        sender_host: sender_host.to_owned(),
        now_ms,
        expiry,
        items,
    }
}

/// A push of the one envelope `id` from `sender` (host `sender_host`) to `target` with
/// `wire`, at `now_ms` under `expiry`.
pub fn envelope(
    sender: &str,
    sender_host: &str,
    now_ms: i64,
    expiry: Expiry,
    id: &str,
    target: &str,
    wire: &[u8],
) -> PushBatch {
    batch(
        sender,
        sender_host,
        now_ms,
        expiry,
        vec![item(id, &[(target, wire)])],
    )
}

/// A push of envelope `id` that never expires (a v1 item), its wire `wire of {id}`: the items
/// of the backup and restore fixtures.
pub fn kept_envelope(
    sender: &str,
    sender_host: &str,
    now_ms: i64,
    id: &str,
    target: &str,
) -> PushBatch {
    let wire = format!("wire of {id}").into_bytes();
    envelope(
        sender,
        sender_host,
        now_ms,
        Expiry::Never,
        id,
        target,
        &wire,
    )
}

/// An envelope item `id` with one target per `(target key, wire bytes)`.
pub fn item(id: &str, targets: &[(&str, &[u8])]) -> PushItem {
    item_of("envelope", id, targets)
}

/// An item of `kind`.
pub(crate) fn item_of(kind: &str, id: &str, targets: &[(&str, &[u8])]) -> PushItem {
    PushItem {
        kind: kind.to_owned(),
        item_id: id.to_owned(),
        targets: targets
            .iter()
            .map(|(t, w)| PushTarget {
                target_pubkey: (*t).to_owned(),
                wire: bytes::Bytes::copy_from_slice(w),
            })
            .collect(),
    }
}

/// Asserts an ack was applied and returns `(acked_through, deleted)`.
#[track_caller]
pub(crate) fn acked(result: AckResult) -> (i64, u64) {
    match result {
        AckResult::Acked(a) => (a.acked_through, a.deleted),
        other => panic!("expected the ack to apply, got {other:?}"),
    }
}

/// Signs expiry notices for the suite's sweeps: the wire is the notice's facts as text (the
/// store stores it byte for byte; real signatures are the relay's business, not the store's).
#[derive(Debug)]
pub struct FakeNoticeSigner(pub String);

impl NoticeSigner for FakeNoticeSigner {
    fn relay_pubkey(&self) -> String {
        self.0.clone()
    }

    fn notice_wire(&self, facts: &ExpiryFacts) -> Result<Vec<u8>, String> {
        Ok(notice_wire(facts).into_bytes())
    }
}

/// The wire [`FakeNoticeSigner`] gives a notice.
pub fn notice_wire(facts: &ExpiryFacts) -> String {
    format!(
        "notice:{}:{}:{}:{}",
        facts.item_id, facts.target_pubkey, facts.accepted_at_ms, facts.expired_at_ms
    )
}

/// Calls `$cb!($($args)* ; rule, rule, …)` with every [`Rule`] of the suite (those taking a
/// [`Factory`]): with [`__conformance_backend_rules!`](crate::__conformance_backend_rules), the
/// lists the test macro and [`run_all`] are made from.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_rules {
    ($cb:ident ! ($($args:tt)*)) => {
        $crate::$cb! { $($args)*;
            // items
            dedup_same_bytes_is_a_duplicate_with_the_original_seq_and_no_second_row,
            dedup_other_bytes_is_a_conflict_that_changes_nothing,
            dedup_is_keyed_by_sender_item_and_target,
            later_items_of_a_batch_see_earlier_ones,
            seq_is_the_max_of_next_seq_and_now,
            seqs_never_restart_after_acks_expiry_or_a_new_epoch,
            an_item_is_all_or_nothing_over_its_targets,
            a_repeated_or_missing_target_is_refused,
            queue_and_sender_quotas_hold_at_the_bound_and_refuse_past_it,
            the_sender_byte_share_is_a_quota,
            the_account_quota_charges_only_proven_accounts,
            pull_pages_are_bounded_by_count_and_bytes,
            a_pull_page_is_clamped_to_the_most_items_a_page_holds,
            ack_deletes_through_and_its_position_never_goes_back,
            an_ack_out_of_range_or_of_another_epoch_changes_nothing,
            wire_bytes_come_back_byte_for_byte_with_their_hash,
            // directory
            re_enrolment_is_idempotent_and_names_are_labels,
            names_are_unique_inside_a_proven_account,
            a_weaker_authority_keeps_the_stronger_account,
            the_live_enrolment_cap_refuses_only_new_keys,
            only_canonical_host_keys_are_enrolled,
            revocation_sticks,
            enc_key_ads_are_served_until_revoked,
            a_newer_sender_list_replaces_and_refuses_other_senders,
            a_retry_settles_by_dedup_after_the_target_changed,
            rotation_moves_name_account_queue_and_allowlists_and_revokes_the_old_key,
            rotation_appends_the_old_queue_after_the_new_keys_own,
            rotation_refusals_change_nothing,
            deny_entries_match_until_they_end_and_can_be_removed,
            rotation_carries_the_old_keys_deny_entries,
            an_account_binding_is_written_with_its_enrolment_and_a_cloud_key_serves_one_host,
            // operations
            an_item_expires_at_its_expiry_and_not_a_millisecond_before,
            the_tombstone_answers_a_late_retry_as_a_duplicate,
            an_expired_envelope_queues_one_notice_for_its_sender,
            receipts_notices_and_items_of_unenrolled_senders_expire_without_a_notice,
            items_pushed_without_expiry_never_expire,
            dedup_rows_are_pruned_after_the_dedup_horizon_and_not_before,
            a_sweep_signed_by_another_key_is_refused,
            a_new_epoch_keeps_every_item_and_position,
            a_logged_epoch_rotation_writes_its_receipt,
            the_heartbeat_reads_back_what_was_written,
            meta_values_read_back_and_reserved_keys_are_refused,
            the_relay_log_is_newest_first,
            logged_operator_changes_write_their_entry_only_when_they_change_something,
        }
    };
}

/// Calls `$cb!($($args)* ; rule, rule, …)` with every [`BackendRule`] of the suite (backup and
/// restore).
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_backend_rules {
    ($cb:ident ! ($($args:tt)*)) => {
        $crate::$cb! { $($args)*;
            backup_then_restore_round_trips_the_store,
            restore_carries_forward_what_came_after_the_backup,
        }
    };
}

/// Expands to one `#[test]` per conformance rule, named after the rule, each calling it with
/// `&$factory` (a `fn(&Setup) -> Opened`) or, for the backup and restore rules, with
/// `&$backend` (a [`Backend`](crate::testing::conformance::Backend)).
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr, $backend:expr) => {
        $crate::__conformance_rules! { __conformance_tests!($factory) }
        $crate::__conformance_backend_rules! { __conformance_tests!($backend) }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($arg:expr; $($rule:ident),* $(,)?) => {
        $(
            #[test]
            fn $rule() {
                $crate::testing::conformance::$rule(&$arg);
            }
        )*
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_table {
    ($kind:ident; $($rule:ident),* $(,)?) => {
        &[$((stringify!($rule), $crate::testing::conformance::$rule as $crate::testing::conformance::$kind)),*]
    };
}

/// One rule of the suite: checks one store rule against a store the factory opens, panicking
/// when the store breaks it.
pub type Rule = fn(&Factory);

/// One backup and restore rule of the suite: checks one rule against the [`Backend`],
/// panicking when the backend breaks it.
pub type BackendRule = fn(&Backend);

/// Every rule, by name.
pub const RULES: &[(&str, Rule)] = crate::__conformance_rules!(__conformance_table!(Rule));

/// Every [`BackendRule`], by name.
pub const BACKEND_RULES: &[(&str, BackendRule)] =
    crate::__conformance_backend_rules!(__conformance_table!(BackendRule));

/// Runs every rule, in order: the [`RULES`] against `make`, then the [`BACKEND_RULES`]
/// against `backend`. The first rule that fails panics; the name of each rule is printed to
/// stderr before it runs, so the last one printed is the one that failed.
pub fn run_all(make: &Factory, backend: &Backend) {
    for (name, rule) in RULES {
        eprintln!("conformance rule {name}");
        rule(make);
    }
    for (name, rule) in BACKEND_RULES {
        eprintln!("conformance rule {name}");
        rule(backend);
    }
}
