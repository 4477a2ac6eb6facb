//! Rules of the item queues (spec §2 items, dedup, seqs, acked; §3 push; §4 pull and ack; §7
//! quotas and bounds).

use crate::store::{
    wire_hash, AckResult, Expiry, ItemStatus, QuotaKind, Rejection, StoreLimits, MAX_PULL_ITEMS,
};

use super::{acked, item, key, Factory, Store, T0};
use crate::store::{PushItem, PushOutcome};

/// Spec §3 "Dedup": the same (sender, item id, target) with the same bytes answers
/// `duplicate` with the original seq and acceptance time, and stores no second copy.
pub fn dedup_same_bytes_is_a_duplicate_with_the_original_seq_and_no_second_row(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let first = st.push_one(&alpha, T0, item("m1", &[(&beta, b"sealed")]));
    assert_eq!(first.status, ItemStatus::Accepted, "{first:?}");
    assert_eq!(first.at_ms, Some(T0));
    let head = st.info(&beta).head_seq;
    let again = st.push_one(&alpha, T0 + 5_000, item("m1", &[(&beta, b"sealed")]));
    assert_eq!(again.status, ItemStatus::Duplicate, "{again:?}");
    assert_eq!(again.targets, first.targets, "the original seq and hash");
    assert_eq!(again.at_ms, Some(T0), "the original acceptance time");
    assert_eq!(st.queued_ids(&beta), ["m1"], "no second row");
    assert_eq!(st.info(&beta).head_seq, head, "no seq allocated");
    assert_eq!(
        st.s.dedup_targets(&alpha, "m1").expect("dedup targets"),
        vec![beta.clone()]
    );
    // Still a duplicate once the item was acked (the dedup row outlives the item).
    acked(st.ack(&beta, head, None));
    let late = st.push_one(&alpha, T0 + 9_000, item("m1", &[(&beta, b"sealed")]));
    assert_eq!(late.status, ItemStatus::Duplicate, "{late:?}");
    assert_eq!(late.targets, first.targets);
    assert!(st.pull_all(&beta).items.is_empty(), "never delivered again");
}

/// Spec §3 "Dedup": other bytes under the same (sender, item id, target) are
/// `rejected:conflict`, and nothing changes.
pub fn dedup_other_bytes_is_a_conflict_that_changes_nothing(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    st.push_one(&alpha, T0, item("m1", &[(&beta, b"one")]));
    let head = st.info(&beta).head_seq;
    let other = st.push_one(&alpha, T0 + 1, item("m1", &[(&beta, b"two")]));
    assert_eq!(other.status, ItemStatus::Rejected(Rejection::Conflict));
    assert_eq!((other.at_ms, other.targets.len()), (None, 0), "{other:?}");
    let page = st.pull_all(&beta);
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].wire, b"one", "the first bytes are kept");
    assert_eq!(st.info(&beta).head_seq, head);
}

/// Spec §2 dedup key: another sender, or another target, under the same item id is a fresh
/// item; an item whose targets are partly stored is accepted at now, the stored target keeping
/// its seq.
pub fn dedup_is_keyed_by_sender_item_and_target(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta, gamma, delta) = (key(1), key(2), key(3), key(4));
    for (k, n) in [(&alpha, "alpha"), (&beta, "beta"), (&gamma, "gamma")] {
        st.enrol(k, n);
    }
    st.enrol(&delta, "delta");
    let one = st.push_one(&alpha, T0, item("m", &[(&beta, b"b")]));
    let by_other = st.push_one(&delta, T0, item("m", &[(&beta, b"b")]));
    assert_eq!(by_other.status, ItemStatus::Accepted, "another sender");
    assert_ne!(by_other.targets[0].seq, one.targets[0].seq);
    let both = st.push_one(
        &alpha,
        T0 + 7_000,
        item("m", &[(&beta, b"b"), (&gamma, b"g")]),
    );
    assert_eq!(both.status, ItemStatus::Accepted, "{both:?}");
    assert_eq!(both.at_ms, Some(T0 + 7_000), "a fresh target: accepted now");
    assert_eq!(both.targets[0], one.targets[0], "beta keeps its seq");
    assert_eq!(both.targets[1].target_pubkey, gamma);
    assert_eq!(both.targets[1].seq, T0 + 7_000);
    assert_eq!(st.queued_ids(&beta), ["m", "m"], "one per sender");
    let mut targets = st.s.dedup_targets(&alpha, "m").expect("dedup targets");
    targets.sort();
    let mut want = vec![beta.clone(), gamma.clone()];
    want.sort();
    assert_eq!(targets, want);
}

/// The batch of the in-order rule (spec §3), all to `target`: "a", the same "a" again, "a" with
/// other bytes, then "b".
pub(crate) fn in_order_batch(target: &str) -> Vec<PushItem> {
    vec![
        item("a", &[(target, b"1")]),
        item("a", &[(target, b"1")]),
        item("a", &[(target, b"2")]),
        item("b", &[(target, b"3")]),
    ]
}

/// Asserts the outcome of [`in_order_batch`]: accepted, duplicate (at the first's seq),
/// conflict, accepted (at the next seq).
#[track_caller]
pub(crate) fn assert_in_order_outcome(out: &PushOutcome) {
    let statuses: Vec<String> = out.items.iter().map(|o| o.status.wire()).collect();
    assert_eq!(
        statuses,
        ["accepted", "duplicate", "rejected:conflict", "accepted"]
    );
    assert_eq!(out.items[1].targets[0].seq, out.items[0].targets[0].seq);
    assert_eq!(out.items[3].targets[0].seq, out.items[0].targets[0].seq + 1);
}

/// The limits of the queue and sender quota rule (spec §7): 3 items and 30 bytes per queue,
/// 2 items per sender per queue.
pub(crate) fn quota_limits() -> StoreLimits {
    StoreLimits {
        max_queue_items: 3,
        max_queue_bytes: 30,
        max_sender_items: 2,
        max_sender_bytes: 1_000,
        ..StoreLimits::default()
    }
}

/// Spec §3: the items of one push apply in order, each seeing the ones before it.
pub fn later_items_of_a_batch_see_earlier_ones(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let out = st.push(&alpha, T0, in_order_batch(&beta));
    assert_in_order_outcome(&out);
    assert_eq!(out.epoch, st.epoch(), "committed under the current epoch");
    assert_eq!(st.queued_ids(&beta), ["a", "b"]);
}

/// Spec §2 seqs: a new seq is `max(next_seq, now_ms)`: the clock when it moved, the next one
/// when it did not or went back; the first seq of a queue is at least 1.
pub fn seq_is_the_max_of_next_seq_and_now(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    st.enrol(&alpha, "alpha");
    st.enrol(&beta, "beta");
    st.enrol(&gamma, "gamma");
    let mut seqs = Vec::new();
    for (i, now) in [(0, T0), (1, T0), (2, T0 - 500), (3, T0 + 50_000)] {
        let o = st.push_one(&alpha, now, item(&format!("m{i}"), &[(&beta, b"w")]));
        seqs.push(o.targets[0].seq);
    }
    assert_eq!(seqs, [T0, T0 + 1, T0 + 2, T0 + 50_000]);
    assert_eq!(st.info(&beta).head_seq, T0 + 50_000);
    assert_eq!(st.info(&gamma).head_seq, 0, "no seq yet");
    let o = st.push_one(&alpha, 0, item("g", &[(&gamma, b"w")]));
    assert_eq!(o.targets[0].seq, 1, "a queue's first seq at clock 0");
}

/// Spec §2 seqs and §5: seqs are never reused and never restart — not after the queue was
/// acked empty, its items expired, or the epoch rotated, even with the clock far behind.
pub fn seqs_never_restart_after_acks_expiry_or_a_new_epoch(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let s1 = st
        .push_one(&alpha, T0, item("m1", &[(&beta, b"w")]))
        .targets[0]
        .seq;
    acked(st.ack(&beta, s1, None));
    let s2 = st
        .push_one(&alpha, T0 - 60_000, item("m2", &[(&beta, b"w")]))
        .targets[0]
        .seq;
    assert!(s2 > s1, "after an ack: {s2} > {s1}");
    let retention = i64::from(StoreLimits::default().retention_days) * super::DAY;
    assert_eq!(st.sweep(T0 + retention + 1).expired_items, 1);
    let s3 = st
        .push_one(&alpha, T0, item("m3", &[(&beta, b"w")]))
        .targets[0]
        .seq;
    assert!(s3 > s2, "after expiry: {s3} > {s2}");
    st.s.rotate_epoch().expect("rotate epoch");
    let s4 = st
        .push_one(&alpha, 10, item("m4", &[(&beta, b"w")]))
        .targets[0]
        .seq;
    assert_eq!(s4, s3 + 1, "a new epoch does not restart seqs");
    assert_eq!(st.info(&beta).head_seq, s4);
}

/// Spec §3 "One transaction per item": when any target fails (not enrolled, revoked, over a
/// quota) the whole item is rejected and nothing of it is stored: no row, no seq, no dedup
/// entry.
pub fn an_item_is_all_or_nothing_over_its_targets(make: &Factory) {
    let st = Store::open_limited(
        make,
        StoreLimits {
            max_queue_items: 1,
            ..StoreLimits::default()
        },
    );
    let (alpha, beta, gamma, revoked, stranger) = (key(1), key(2), key(3), key(4), key(9));
    for (k, n) in [(&alpha, "alpha"), (&beta, "beta"), (&gamma, "gamma")] {
        st.enrol(k, n);
    }
    st.enrol(&revoked, "revoked");
    st.s.revoke(&revoked, T0).expect("revoke");
    for bad in [&stranger, &revoked] {
        let out = st.push_one(&alpha, T0, item("m1", &[(&beta, b"b"), (bad, b"x")]));
        assert_eq!(out.status.wire(), "rejected:target not enrolled", "{out:?}");
    }
    // The second target's quota fails after the first target passed.
    st.push_one(&alpha, T0, item("fill", &[(&gamma, b"x")]));
    let out = st.push_one(&alpha, T0 + 1, item("m2", &[(&beta, b"b"), (&gamma, b"g")]));
    assert_eq!(
        out.status.wire(),
        "rejected:quota:queue depth exceeded for gamma"
    );
    assert!(st.pull_all(&beta).items.is_empty(), "no row");
    assert_eq!(st.info(&beta).head_seq, 0, "no seq used");
    for id in ["m1", "m2"] {
        assert!(
            st.s.dedup_targets(&alpha, id).expect("dedup").is_empty(),
            "no dedup entry for {id}"
        );
    }
    // So the same id with other bytes for beta alone is fresh, not a conflict.
    let retry = st.push_one(&alpha, T0 + 2, item("m2", &[(&beta, b"other")]));
    assert_eq!(retry.status, ItemStatus::Accepted, "{retry:?}");
}

/// Spec §3: a repeated target is `rejected:duplicate target`, no target at all is
/// `rejected:bad targets`; nothing is stored.
pub fn a_repeated_or_missing_target_is_refused(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let out = st.push_one(&alpha, T0, item("m", &[(&beta, b"1"), (&beta, b"1")]));
    assert_eq!(out.status.wire(), "rejected:duplicate target");
    let out = st.push_one(&alpha, T0, item("m", &[]));
    assert_eq!(out.status.wire(), "rejected:bad targets");
    assert!(st.pull_all(&beta).items.is_empty());
    assert_eq!(st.info(&beta).head_seq, 0);
}

/// Spec §7: per target, items and bytes; per sender per target, items. An item exactly at a
/// bound fits, one past it is rejected with the quota's name; a duplicate is never charged.
pub fn queue_and_sender_quotas_hold_at_the_bound_and_refuse_past_it(make: &Factory) {
    let st = Store::open_limited(make, quota_limits());
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    st.enrol(&alpha, "alpha");
    st.enrol(&beta, "Beta");
    st.enrol(&gamma, "gamma");
    let status = |sender: &str, id: &str, wire: &[u8]| {
        st.push_one(sender, T0, item(id, &[(&beta, wire)]))
            .status
            .wire()
    };
    assert_eq!(status(&alpha, "a1", &[1; 10]), "accepted");
    assert_eq!(status(&alpha, "a2", &[2; 10]), "accepted");
    assert_eq!(
        status(&alpha, "a3", &[3; 1]),
        "rejected:quota:sender share exceeded for Beta"
    );
    assert_eq!(status(&alpha, "a2", &[2; 10]), "duplicate", "never charged");
    assert_eq!(
        status(&gamma, "g1", &[4; 10]),
        "accepted",
        "30 bytes: at the bound"
    );
    assert_eq!(
        status(&gamma, "g2", &[5; 1]),
        "rejected:quota:queue depth exceeded for Beta"
    );
    // Free one slot: now bytes bind (20 + 11 > 30).
    let first = st.queued_seqs(&beta)[0];
    acked(st.ack(&beta, first, None));
    assert_eq!(
        status(&gamma, "g3", &[6; 11]),
        "rejected:quota:queue bytes exceeded for Beta"
    );
    assert_eq!(status(&gamma, "g4", &[7; 10]), "accepted");
    assert_eq!(st.queued_ids(&beta), ["a2", "g1", "g4"]);
}

/// Spec §7: one sender's bytes queued for one target are bounded too.
pub fn the_sender_byte_share_is_a_quota(make: &Factory) {
    let st = Store::open_limited(
        make,
        StoreLimits {
            max_sender_bytes: 20,
            ..StoreLimits::default()
        },
    );
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    st.enrol(&alpha, "alpha");
    st.enrol(&beta, "beta");
    st.enrol(&gamma, "gamma");
    let push = |sender: &str, id: &str, n: usize| {
        st.push_one(sender, T0, item(id, &[(&beta, &vec![7u8; n])]))
            .status
    };
    assert_eq!(push(&alpha, "a1", 12), ItemStatus::Accepted);
    assert_eq!(push(&alpha, "a2", 8), ItemStatus::Accepted, "exactly 20");
    assert_eq!(
        push(&alpha, "a3", 1),
        ItemStatus::Rejected(Rejection::Quota {
            kind: QuotaKind::SenderShare,
            host: "beta".to_owned()
        })
    );
    assert_eq!(push(&gamma, "g1", 20), ItemStatus::Accepted, "per sender");
}

/// Spec §7: a proven account's hosts share one item quota; hosts without a proven account
/// (an owner claim is not proof) are never charged; a revoked host's queue stops counting.
pub fn the_account_quota_charges_only_proven_accounts(make: &Factory) {
    let st = Store::open_limited(
        make,
        StoreLimits {
            max_owner_items: 2,
            ..StoreLimits::default()
        },
    );
    let (alpha, b1, b2, loose) = (key(1), key(2), key(3), key(4));
    st.enrol(&alpha, "alpha");
    for (k, name) in [(&b1, "one"), (&b2, "two")] {
        let out = st.enrol_as(k, name, Some("acct"));
        assert!(matches!(out, crate::store::EnrolOutcome::Enrolled(_)));
    }
    st.enrol(&loose, "loose");
    let status = |now: i64, id: &str, target: &str| {
        st.push_one(&alpha, now, item(id, &[(target, b"x")]))
            .status
            .wire()
    };
    assert_eq!(status(T0, "1", &b1), "accepted");
    assert_eq!(status(T0, "2", &b2), "accepted");
    assert_eq!(
        status(T0, "3", &b2),
        "rejected:quota:owner queue depth exceeded for two"
    );
    for i in 0..3 {
        assert_eq!(
            status(T0, &format!("l{i}"), &loose),
            "accepted",
            "no account"
        );
    }
    st.s.revoke(&b2, T0 + 1).expect("revoke");
    assert_eq!(status(T0 + 2, "4", &b1), "accepted");
    assert_eq!(
        status(T0 + 2, "5", &b1),
        "rejected:quota:owner queue depth exceeded for one"
    );
}

/// Spec §4: a page stops at `limit` items or before exceeding `max_bytes`, always holds one
/// item when one exists, reports `last_seq`, `head_seq` and `more`, and an empty page past the
/// end has `last_seq = after`.
pub fn pull_pages_are_bounded_by_count_and_bytes(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let mut seqs = Vec::new();
    for (i, n) in [10usize, 10, 50, 10, 10].iter().enumerate() {
        let wire = vec![b'a' + i as u8; *n];
        let o = st.push_one(&alpha, T0, item(&format!("m{i}"), &[(&beta, &wire)]));
        seqs.push(o.targets[0].seq);
    }
    let p = st.pull(&beta, 0, 2, u64::MAX);
    assert_eq!(p.items.iter().map(|i| i.seq).collect::<Vec<_>>(), seqs[..2]);
    assert_eq!((p.last_seq, p.more, p.head_seq), (seqs[1], true, seqs[4]));
    assert_eq!(
        (p.items[0].item_id.as_str(), p.items[0].kind.as_str()),
        ("m0", "envelope")
    );
    assert_eq!(
        (
            p.items[0].sender_pubkey.as_str(),
            p.items[0].wire.as_slice()
        ),
        (alpha.as_str(), [b'a'; 10].as_slice())
    );
    assert_eq!(p.epoch, st.epoch());
    assert_eq!(st.pull(&beta, 0, 0, u64::MAX).items.len(), 1, "limit 0 → 1");
    let p = st.pull(&beta, 0, 500, 25);
    assert_eq!((p.items.len(), p.last_seq, p.more), (2, seqs[1], true));
    let p = st.pull(&beta, seqs[1], 500, 25);
    assert_eq!(p.items.len(), 1, "an item over the budget comes alone");
    assert_eq!((p.last_seq, p.more), (seqs[2], true));
    let p = st.pull(&beta, seqs[2], 500, 20);
    assert_eq!((p.items.len(), p.last_seq, p.more), (2, seqs[4], false));
    let p = st.pull(&beta, seqs[4], 500, 25);
    assert_eq!((p.items.len(), p.last_seq, p.more), (0, seqs[4], false));
    let p = st.pull_all(&key(77));
    assert_eq!((p.head_seq, p.last_seq, p.more), (0, 0, false), "no queue");
}

/// `wire.md` §3.2: a page holds at most [`MAX_PULL_ITEMS`] items whatever the limit asked.
pub fn a_pull_page_is_clamped_to_the_most_items_a_page_holds(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let n = MAX_PULL_ITEMS as usize + 1;
    let items = (0..n)
        .map(|i| item(&format!("m{i}"), &[(&beta, b"w")]))
        .collect();
    st.push(&alpha, T0, items);
    let p = st.pull(&beta, 0, 10_000, u64::MAX);
    assert_eq!(p.items.len(), MAX_PULL_ITEMS as usize);
    assert!(p.more);
    let rest = st.pull(&beta, p.last_seq, 10_000, u64::MAX);
    assert_eq!((rest.items.len(), rest.more), (1, false));
}

/// Spec §4: an ack deletes the items through `through` and records `acked_through`, which
/// never decreases; acking through 0 on an empty queue is fine.
pub fn ack_deletes_through_and_its_position_never_goes_back(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    for i in 0..5 {
        st.push_one(&alpha, 100, item(&format!("m{i}"), &[(&beta, b"w")]));
    }
    let epoch = st.epoch();
    match st.ack(&beta, 102, Some(&epoch)) {
        AckResult::Acked(a) => {
            assert_eq!((a.acked_through, a.deleted, a.head_seq), (102, 3, 104));
            assert_eq!(a.epoch, epoch);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(st.queued_seqs(&beta), [103, 104]);
    assert_eq!(acked(st.ack(&beta, 101, None)), (102, 0), "never back");
    assert_eq!(st.info(&beta).acked_through, 102);
    assert_eq!(acked(st.ack(&beta, 104, None)), (104, 2));
    let info = st.info(&beta);
    assert_eq!((info.head_seq, info.acked_through), (104, 104));
    assert_eq!(acked(st.ack(&key(50), 0, None)), (0, 0), "empty queue");
}

/// Spec §4, `wire.md` §3.2 "Ack": an ack past the head or below 0 is out of range, an ack
/// naming another epoch is stale; both change nothing and report the head and epoch.
pub fn an_ack_out_of_range_or_of_another_epoch_changes_nothing(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    for i in 0..2 {
        st.push_one(&alpha, 100, item(&format!("m{i}"), &[(&beta, b"w")]));
    }
    let epoch = st.epoch();
    for through in [102, -1, i64::MIN, i64::MAX] {
        assert_eq!(
            st.ack(&beta, through, None),
            AckResult::OutOfRange {
                head_seq: 101,
                epoch: epoch.clone()
            },
            "through {through}"
        );
    }
    assert_eq!(
        st.ack(&beta, 101, Some("another-epoch")),
        AckResult::StaleEpoch {
            epoch: epoch.clone(),
            head_seq: 101
        }
    );
    assert_eq!(st.queued_seqs(&beta), [100, 101], "nothing deleted");
    assert_eq!(st.info(&beta).acked_through, 0);
}

/// Spec §2 items: the wire bytes are stored exactly as received and `wire_hash` is the
/// lowercase hex SHA-256 of those bytes.
pub fn wire_bytes_come_back_byte_for_byte_with_their_hash(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    let wire: Vec<u8> = (0..=255u8).chain([0, 0xff, b'\n']).collect();
    let o = st.push_one(&alpha, T0, item("m", &[(&beta, &wire)]));
    assert_eq!(o.targets[0].wire_hash, wire_hash(&wire));
    assert_eq!(
        o.targets[0].wire_hash,
        o.targets[0].wire_hash.to_lowercase()
    );
    let r = st.push_one(&alpha, T0, item("r", &[(&beta, b"rcpt")]));
    assert_eq!(r.status, ItemStatus::Accepted);
    let page = st.pull_all(&beta);
    assert_eq!(page.items[0].wire, wire);
    assert_eq!(page.items[0].sender_host, "sender");
    let v1 = st.push_expiring(
        &alpha,
        T0,
        Expiry::Never,
        vec![item("v1", &[(&beta, b"v")])],
    );
    assert_eq!(v1.items[0].status, ItemStatus::Accepted);
}
