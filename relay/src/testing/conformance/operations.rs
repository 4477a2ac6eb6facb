//! Rules of retention and operations (spec §5 epoch, heartbeat, relay log; §6 retention and
//! expiry; §7 the dedup horizon).

use std::sync::Arc;

use serde_json::json;

use crate::store::{
    DenyEntry, DenyKind, DenyOutcome, Expiry, ExpiryFacts, ItemStatus, OpEntry, RevokeOutcome,
    StoreError, StoreLimits, DEDUP_GRACE_DAYS, OPS_KEEP, SWEEP_OPS_KEEP,
};

use super::{
    acked, item, item_of, key, notice_wire, relay_key, Factory, FakeNoticeSigner, Store, DAY, T0,
};

/// The default retention in ms.
fn retention() -> i64 {
    i64::from(StoreLimits::default().retention_days) * DAY
}

/// A relay log entry of `op` at `at_ms`.
fn op(at_ms: i64, op: &str) -> OpEntry {
    OpEntry {
        at_ms,
        op: op.to_owned(),
        receipt: json!({"v": 1, "type": op, "at": at_ms}),
    }
}

/// Spec §6: `expires_at = accepted_at + retention`; the sweep deletes an item exactly then,
/// not a millisecond before.
pub fn an_item_expires_at_its_expiry_and_not_a_millisecond_before(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    st.push_one(&alpha, T0, item("m1", &[(&beta, b"sealed-1")]));
    let early = st.sweep(T0 + retention() - 1);
    assert!(!early.changed(), "{early:?}");
    assert_eq!(st.queued_ids(&beta), ["m1"], "kept 1 ms before expiry");
    let at = st.sweep(T0 + retention());
    assert_eq!(
        (at.expired_items, at.expired_envelopes, at.expired_bytes),
        (1, 1, 8),
        "{at:?}"
    );
    assert!(at.changed());
    assert!(st.pull_all(&beta).items.is_empty(), "deleted at expiry");
    assert!(!st.sweep(T0 + retention() + 1).changed(), "once");
}

/// Spec §6: an expired item leaves a tombstone in dedup, so a late retry is a duplicate with
/// the original seq and time (never delivered again) and other bytes are still a conflict.
pub fn the_tombstone_answers_a_late_retry_as_a_duplicate(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let first = st.push_one(&alpha, T0, item("m1", &[(&beta, b"sealed-1")]));
    let head = st.info(&beta).head_seq;
    assert_eq!(st.sweep(T0 + retention()).expired_items, 1);
    let late = T0 + retention() + 60_000;
    let retry = st.push_one(&alpha, late, item("m1", &[(&beta, b"sealed-1")]));
    assert_eq!(retry.status, ItemStatus::Duplicate, "{retry:?}");
    assert_eq!((retry.targets, retry.at_ms), (first.targets, Some(T0)));
    assert!(st.pull_all(&beta).items.is_empty(), "never delivered again");
    assert_eq!(st.info(&beta).head_seq, head);
    let other = st.push_one(&alpha, late, item("m1", &[(&beta, b"sealed-2")]));
    assert_eq!(other.status.wire(), "rejected:conflict");
}

/// Spec §6: an expired envelope queues, for its sender, one `expired` notice item from the
/// relay key with id `expired:<item_id>:<target>` and the signer's wire bytes, under a normal
/// seq; a second sweep queues no second one.
pub fn an_expired_envelope_queues_one_notice_for_its_sender(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    st.push_one(&alpha, T0, item("m1", &[(&beta, b"sealed-1")]));
    let now = T0 + retention();
    let report = st.sweep(now);
    assert_eq!(
        (report.expired_envelopes, report.notices),
        (1, 1),
        "{report:?}"
    );
    let page = st.pull_all(&alpha);
    assert_eq!(page.items.len(), 1, "{page:?}");
    let notice = &page.items[0];
    assert_eq!(notice.kind, "expired");
    assert_eq!(notice.item_id, format!("expired:m1:{beta}"));
    assert_eq!(
        (notice.sender_pubkey.as_str(), notice.sender_host.as_str()),
        (relay_key().as_str(), "relay")
    );
    let facts = ExpiryFacts {
        item_id: "m1".to_owned(),
        target_pubkey: beta.clone(),
        accepted_at_ms: T0,
        expired_at_ms: now,
    };
    assert_eq!(notice.wire, notice_wire(&facts).into_bytes());
    assert_eq!(notice.seq, now, "a normal seq: max(next_seq, now)");
    let again = st.sweep(now + 1);
    assert_eq!(again.notices, 0, "{again:?}");
    assert_eq!(st.pull_all(&alpha).items.len(), 1, "one notice, not two");
}

/// Spec §6: expired receipts and notices are dropped without a notice, and an expired
/// envelope of a sender that is not enrolled (unknown or revoked) gets none either.
pub fn receipts_notices_and_items_of_unenrolled_senders_expire_without_a_notice(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta, gone) = (key(1), key(2), key(3));
    st.enrol(&alpha, "alpha");
    st.enrol(&beta, "beta");
    st.enrol(&gone, "gone");
    st.push_one(&alpha, T0, item_of("receipt", "r1", &[(&beta, b"rcpt")]));
    st.push_one(&gone, T0, item("m1", &[(&beta, b"sealed")]));
    assert_eq!(
        st.s.revoke(&gone, T0 + 1).expect("revoke"),
        RevokeOutcome::Revoked
    );
    let report = st.sweep(T0 + retention());
    assert_eq!(
        (
            report.expired_items,
            report.expired_receipts,
            report.expired_envelopes
        ),
        (2, 1, 1),
        "{report:?}"
    );
    assert_eq!(
        (report.notices, report.notices_not_enrolled),
        (0, 1),
        "{report:?}"
    );
    assert!(
        st.pull_all(&alpha).items.is_empty(),
        "no notice for a receipt"
    );
    assert!(st.pull_all(&gone).items.is_empty());
    // A notice itself expires silently too.
    st.push_one(&alpha, T0 + retention(), item("m2", &[(&beta, b"sealed")]));
    assert_eq!(st.sweep(T0 + 2 * retention()).notices, 1);
    let last = st.sweep(T0 + 3 * retention());
    assert_eq!((last.expired_notices, last.notices), (1, 0), "{last:?}");
    assert!(st.pull_all(&alpha).items.is_empty());
}

/// `wire.md` §3.2 "Sweep": items pushed without expiry (the v1 endpoints) never expire.
pub fn items_pushed_without_expiry_never_expire(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let out = st.push_expiring(
        &alpha,
        T0,
        Expiry::Never,
        vec![item("v1", &[(&beta, b"v")])],
    );
    assert_eq!(out.items[0].status, ItemStatus::Accepted);
    assert!(!st.sweep(T0 + 100 * retention()).changed());
    assert_eq!(st.queued_ids(&beta), ["v1"]);
}

/// Spec §7: a dedup row is kept for retention + 7 days after its item was accepted (and is
/// gone), then pruned: past the horizon the item id is new again.
pub fn dedup_rows_are_pruned_after_the_dedup_horizon_and_not_before(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let seq = st
        .push_one(&alpha, T0, item("m1", &[(&beta, b"w")]))
        .targets[0]
        .seq;
    acked(st.ack(&beta, seq, None));
    let horizon = T0 + retention() + DEDUP_GRACE_DAYS * DAY;
    assert_eq!(st.sweep(horizon).pruned_dedup, 0, "kept at the horizon");
    assert_eq!(
        st.s.dedup_targets(&alpha, "m1").expect("dedup"),
        vec![beta.clone()]
    );
    let past = st.sweep(horizon + 1);
    assert_eq!(past.pruned_dedup, 1, "{past:?}");
    assert!(st.s.dedup_targets(&alpha, "m1").expect("dedup").is_empty());
    let again = st.push_one(&alpha, horizon + 2, item("m1", &[(&beta, b"w")]));
    assert_eq!(again.status, ItemStatus::Accepted);
    assert!(again.targets[0].seq > seq);
}

/// [`OperationsStore::sweep`](crate::store::OperationsStore::sweep): a notice signer of another key than
/// the store's is refused and nothing changes.
pub fn a_sweep_signed_by_another_key_is_refused(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    st.push_one(&alpha, T0, item("m1", &[(&beta, b"w")]));
    let other = Arc::new(FakeNoticeSigner(key(201)));
    let e = st.s.sweep(T0 + retention(), other).expect_err("refused");
    assert!(matches!(e, StoreError::InvalidInput(_)), "{e:?}");
    assert_eq!(st.queued_ids(&beta), ["m1"]);
}

/// Spec §5: a new epoch is new and random, read on each call, and keeps every item, seq and
/// ack position (only receivers' positions reset, on their side); pages and acks name it.
pub fn a_new_epoch_keeps_every_item_and_position(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    for i in 0..3 {
        st.push_one(&alpha, T0, item(&format!("m{i}"), &[(&beta, b"w")]));
    }
    acked(st.ack(&beta, T0, None));
    let before = st.epoch();
    let info = st.info(&beta);
    let rot = st.s.rotate_epoch().expect("rotate");
    assert_eq!(rot.from, before);
    assert_ne!(rot.to, before);
    assert_eq!(st.epoch(), rot.to, "read on each call");
    assert_eq!(st.info(&beta), info);
    let page = st.pull_all(&beta);
    assert_eq!(
        (page.epoch.as_str(), page.items.len()),
        (rot.to.as_str(), 2)
    );
    assert_eq!(st.s.relay_pubkey().expect("relay key"), relay_key());
    let second = st.s.rotate_epoch().expect("rotate");
    assert_ne!(second.to, rot.to);
    assert_ne!(second.to, before);
}

/// Spec §5, `wire.md` §3.4: a logged epoch rotation appends its receipt, with `from` and
/// `to`, to the relay log and to `meta.epoch_rotated` with the new epoch.
pub fn a_logged_epoch_rotation_writes_its_receipt(make: &Factory) {
    let st = Store::open(make);
    let before = st.epoch();
    let (rot, receipt) =
        st.s.rotate_epoch_logged(op(T0, "relay-rotate-epoch"))
            .expect("rotate");
    assert_eq!(
        (rot.from.as_str(), st.epoch()),
        (before.as_str(), rot.to.clone())
    );
    assert_eq!(
        (receipt["from"].as_str(), receipt["to"].as_str()),
        (Some(before.as_str()), Some(rot.to.as_str()))
    );
    let log = st.s.ops(10).expect("ops");
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(
        (log[0].op.as_str(), log[0].at_ms),
        ("relay-rotate-epoch", T0)
    );
    assert_eq!(log[0].receipt, receipt);
    let meta = st.s.meta("epoch_rotated").expect("meta").expect("written");
    let stored: serde_json::Value = serde_json::from_str(&meta).expect("JSON");
    assert_eq!(stored, receipt);
    let refused = st.s.rotate_epoch_logged(OpEntry {
        receipt: json!("not an object"),
        ..op(T0, "relay-rotate-epoch")
    });
    assert!(
        matches!(refused, Err(StoreError::InvalidInput(_))),
        "{refused:?}"
    );
    assert_eq!(st.epoch(), rot.to, "refused: no new epoch");
}

/// Spec §5: a store never served has no heartbeat; a written one reads back.
pub fn the_heartbeat_reads_back_what_was_written(make: &Factory) {
    let st = Store::open(make);
    assert_eq!(st.s.heartbeat().expect("heartbeat"), None);
    st.s.set_heartbeat(T0 + 30_000).expect("write");
    assert_eq!(st.s.heartbeat().expect("heartbeat"), Some(T0 + 30_000));
    st.s.set_heartbeat(T0 + 60_000).expect("write");
    assert_eq!(st.s.heartbeat().expect("heartbeat"), Some(T0 + 60_000));
    st.s.writer_answers().expect("the writer answers");
}

/// Spec §2 meta: free-form values read back and are replaced; the store's own keys are
/// refused.
pub fn meta_values_read_back_and_reserved_keys_are_refused(make: &Factory) {
    let st = Store::open(make);
    assert_eq!(st.s.meta("nothing").expect("meta"), None);
    st.s.set_meta("restored", "one").expect("set");
    st.s.set_meta("restored", "two").expect("replace");
    assert_eq!(st.s.meta("restored").expect("meta").as_deref(), Some("two"));
    let epoch = st.epoch();
    for k in ["epoch", "relay_pubkey", "schema_version", "heartbeat"] {
        assert!(
            matches!(st.s.set_meta(k, "x"), Err(StoreError::InvalidInput(_))),
            "{k}"
        );
    }
    assert_eq!(st.epoch(), epoch);
}

/// `wire.md` §3.3: the relay log answers newest first, with increasing ids, at most `limit`
/// entries (at least one), and never more than it keeps.
pub fn the_relay_log_is_newest_first(make: &Factory) {
    let st = Store::open(make);
    let mut ids = Vec::new();
    for i in 0..5 {
        let id =
            st.s.append_op(T0 + i, "relay-backup", &json!({"i": i}))
                .expect("append");
        ids.push(id);
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    let all = st.s.ops(OPS_KEEP + SWEEP_OPS_KEEP + 1).expect("ops");
    assert_eq!(all.iter().map(|r| r.id).rev().collect::<Vec<_>>(), ids);
    assert_eq!((all[0].at_ms, &all[0].receipt), (T0 + 4, &json!({"i": 4})));
    assert_eq!(st.s.ops(2).expect("ops").len(), 2);
    assert_eq!(st.s.ops(0).expect("ops").len(), 1, "at least one");
}

/// `wire.md` §3.4: revocations and deny-list changes made with their log entry write it in the
/// same call, and only when they changed something.
pub fn logged_operator_changes_write_their_entry_only_when_they_change_something(make: &Factory) {
    let st = Store::open(make);
    let beta = key(2);
    st.enrol(&beta, "beta");
    let logged = || {
        st.s.ops(100)
            .expect("ops")
            .into_iter()
            .map(|r| r.op)
            .collect::<Vec<_>>()
    };
    let revoked =
        st.s.revoke_logged(&beta, T0, op(T0, "relay-revoke"))
            .expect("revoke");
    assert_eq!(revoked, RevokeOutcome::Revoked);
    let again =
        st.s.revoke_logged(&beta, T0, op(T0, "relay-revoke"))
            .expect("revoke");
    assert_eq!(again, RevokeOutcome::AlreadyRevoked);
    assert_eq!(logged(), ["relay-revoke"]);
    let entry = DenyEntry {
        kind: DenyKind::Client,
        value: "cli".to_owned(),
        until_ms: None,
        at_ms: T0,
    };
    let out =
        st.s.deny_logged(entry.clone(), op(T0, "relay-deny"))
            .expect("deny");
    assert_eq!(out, DenyOutcome::Stored(entry));
    assert!(st
        .s
        .undeny_logged(DenyKind::Client, "cli", op(T0, "relay-undeny"))
        .expect("undeny"));
    assert!(!st
        .s
        .undeny_logged(DenyKind::Client, "cli", op(T0, "relay-undeny"))
        .expect("undeny"));
    assert_eq!(logged(), ["relay-undeny", "relay-deny", "relay-revoke"]);
}
