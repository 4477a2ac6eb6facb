//! Pushes: dedup, fan-out all-or-nothing, seq allocation, expiry.

use super::*;

#[test]
fn dedup_absent_duplicate_and_conflict() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);

    let first = push_one(&store, &alpha, 5_000, item("m1", &[(&beta, b"sealed-1")]));
    assert_eq!(first.status, ItemStatus::Accepted);
    assert_eq!(first.at_ms, Some(5_000));
    assert_eq!(first.targets.len(), 1);
    assert_eq!(first.targets[0].seq, 5_000);
    assert_eq!(first.targets[0].wire_hash, wire_hash(b"sealed-1"));

    // A retry later: the same seq and the ORIGINAL acceptance time.
    let again = push_one(&store, &alpha, 9_000, item("m1", &[(&beta, b"sealed-1")]));
    assert_eq!(again.status, ItemStatus::Duplicate);
    assert_eq!(again.at_ms, Some(5_000));
    assert_eq!(again.targets, first.targets);

    // Same id, other bytes: conflict, nothing changes.
    let head_before = store.info_for(&beta).expect("info").head_seq;
    let conflict = push_one(&store, &alpha, 9_500, item("m1", &[(&beta, b"sealed-X")]));
    assert_eq!(conflict.status, ItemStatus::Rejected(Rejection::Conflict));
    assert_eq!(conflict.status.wire(), "rejected:conflict");
    assert!(conflict.targets.is_empty());
    let page = pull_all(&store, &beta);
    assert_eq!(page.items.len(), 1, "one stored item, never two");
    assert_eq!(page.items[0].wire, b"sealed-1");
    assert_eq!(page.head_seq, head_before);

    // The dedup key includes the sender: another sender may use the same id.
    let gamma = key(3);
    enrol(&store, &gamma, "gamma");
    let other = push_one(&store, &gamma, 9_600, item("m1", &[(&beta, b"sealed-X")]));
    assert_eq!(other.status, ItemStatus::Accepted);

    // A duplicate stays a duplicate after its item was acked (the dedup row is a tombstone).
    let acked = store
        .ack(AckRequest {
            target_pubkey: beta.clone(),
            through: page.items[0].seq,
            epoch: None,
        })
        .expect("ack");
    assert!(matches!(acked, AckResult::Acked(_)));
    let late = push_one(&store, &alpha, 20_000, item("m1", &[(&beta, b"sealed-1")]));
    assert_eq!(late.status, ItemStatus::Duplicate);
    assert_eq!(late.at_ms, Some(5_000));
}

#[test]
fn mixed_fresh_and_duplicate_targets_are_accepted_at_now() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let gamma = key(3);
    enrol(&store, &gamma, "gamma");
    let one = push_one(&store, &alpha, 5_000, item("m", &[(&beta, b"b")]));
    assert_eq!(one.status, ItemStatus::Accepted);
    let both = push_one(
        &store,
        &alpha,
        7_000,
        item("m", &[(&beta, b"b"), (&gamma, b"g")]),
    );
    assert_eq!(both.status, ItemStatus::Accepted);
    assert_eq!(both.at_ms, Some(7_000));
    assert_eq!(
        both.targets[0].seq, one.targets[0].seq,
        "beta keeps its seq"
    );
    assert_eq!(both.targets[1].target_pubkey, gamma);
    assert_eq!(both.targets[1].seq, 7_000);
}

#[test]
fn later_items_in_one_batch_see_earlier_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let out = push(&store, &alpha, 5_000, in_order_batch(&beta));
    assert_in_order_outcome(&out);
    assert_eq!(out.epoch, store.epoch().expect("epoch"));
    assert_eq!(pull_all(&store, &beta).items.len(), 2);
}

#[test]
fn fan_out_is_all_or_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_limited(
        dir.path(),
        StoreLimits {
            max_queue_items: 1,
            ..StoreLimits::default()
        },
    );
    let (alpha, beta, gamma, stranger) = (key(1), key(2), key(3), key(9));
    enrol(&store, &alpha, "alpha");
    enrol(&store, &beta, "beta");
    enrol(&store, &gamma, "gamma");

    // The second target is not enrolled: the first gets nothing.
    let out = push_one(
        &store,
        &alpha,
        5_000,
        item("m1", &[(&beta, b"for beta"), (&stranger, b"for ?")]),
    );
    assert_eq!(out.status.wire(), "rejected:target not enrolled");
    assert!(pull_all(&store, &beta).items.is_empty());
    assert_eq!(store.info_for(&beta).expect("info").head_seq, 0);

    // The second target's quota fails after the first target was written: rolled back,
    // including the first target's seq allocation and dedup row.
    let fill = push_one(&store, &alpha, 5_000, item("fill", &[(&gamma, b"x")]));
    assert_eq!(fill.status, ItemStatus::Accepted);
    let out = push_one(
        &store,
        &alpha,
        6_000,
        item("m2", &[(&beta, b"for beta"), (&gamma, b"for gamma")]),
    );
    assert_eq!(
        out.status.wire(),
        "rejected:quota:queue depth exceeded for gamma"
    );
    assert!(pull_all(&store, &beta).items.is_empty());
    assert_eq!(
        store.info_for(&beta).expect("info").head_seq,
        0,
        "no seq used"
    );
    // Not a dedup entry either: the same id with other bytes for beta alone is fresh.
    let retry = push_one(&store, &alpha, 7_000, item("m2", &[(&beta, b"other")]));
    assert_eq!(retry.status, ItemStatus::Accepted);
}

#[test]
fn repeated_and_missing_targets_are_refused_defensively() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let out = push_one(
        &store,
        &alpha,
        5_000,
        item("m", &[(&beta, b"1"), (&beta, b"1")]),
    );
    assert_eq!(out.status.wire(), "rejected:duplicate target");
    let out = push_one(&store, &alpha, 5_000, item("m", &[]));
    assert_eq!(out.status.wire(), "rejected:bad targets");
    assert!(pull_all(&store, &beta).items.is_empty());
}

#[test]
fn seq_is_max_of_next_and_now_keeps_rising_and_survives_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (alpha, beta) = (key(1), key(2));
    let mut seqs = Vec::new();
    {
        let store = open(dir.path());
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        for (i, now) in [(0, 1_000), (1, 1_000), (2, 500), (3, 50_000)] {
            let o = push_one(
                &store,
                &alpha,
                now,
                item(&format!("m{i}"), &[(&beta, b"w")]),
            );
            seqs.push(o.targets[0].seq);
        }
        // now, now+1 (clock did not move), next_seq (clock went back), the clock's floor
        assert_eq!(seqs, [1_000, 1_001, 1_002, 50_000]);
        assert_eq!(store.info_for(&beta).expect("info").head_seq, 50_000);
    }
    let store = open(dir.path());
    assert_eq!(store.info_for(&beta).expect("info").head_seq, 50_000);
    // A clock far behind (restored machine): still above everything handed out.
    let o = push_one(&store, &alpha, 10, item("m4", &[(&beta, b"w")]));
    assert_eq!(o.targets[0].seq, 50_001);
    // An empty queue of a new target starts at the clock.
    let gamma = key(3);
    enrol(&store, &gamma, "gamma");
    assert_eq!(store.info_for(&gamma).expect("info").head_seq, 0);
    let o = push_one(&store, &alpha, 0, item("g", &[(&gamma, b"w")]));
    assert_eq!(o.targets[0].seq, 1, "default next_seq is 1");
}

#[test]
fn a_retry_settles_by_dedup_after_the_target_was_revoked_or_changed_its_allowlist() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta, gamma, stranger) = (key(1), key(2), key(3), key(9));
    enrol(&store, &alpha, "alpha");
    enrol(&store, &beta, "beta");
    enrol(&store, &gamma, "gamma");
    let first = push_one(&store, &alpha, 5_000, item("m", &[(&beta, b"w")]));
    assert_eq!(first.status, ItemStatus::Accepted);
    assert_eq!(
        store.dedup_targets(&alpha, "m").expect("dedup"),
        vec![beta.clone()]
    );
    assert!(store.dedup_targets(&gamma, "m").expect("dedup").is_empty());

    // beta's allowlist no longer names alpha.
    let list = SenderList {
        target_pubkey: beta.clone(),
        senders: vec![gamma.clone()],
        iat_ms: 6_000,
        record: "{}".to_owned(),
        sig: "sig".to_owned(),
    };
    assert_eq!(
        store.put_sender_list(list).expect("list"),
        SenderListOutcome::Stored
    );
    let again = push_one(&store, &alpha, 7_000, item("m", &[(&beta, b"w")]));
    assert_eq!(again.status, ItemStatus::Duplicate);
    assert_eq!((again.at_ms, &again.targets), (Some(5_000), &first.targets));
    let other = push_one(&store, &alpha, 7_000, item("m", &[(&beta, b"X")]));
    assert_eq!(other.status, ItemStatus::Rejected(Rejection::Conflict));
    let fresh = push_one(&store, &alpha, 7_000, item("n", &[(&beta, b"w")]));
    assert_eq!(
        fresh.status.wire(),
        "rejected:sender not accepted by target"
    );

    // beta is revoked (after acking the item: the dedup row is a tombstone).
    store
        .ack(AckRequest {
            target_pubkey: beta.clone(),
            through: first.targets[0].seq,
            epoch: None,
        })
        .expect("ack");
    assert_eq!(
        store.revoke(&beta, 8_000).expect("revoke"),
        RevokeOutcome::Revoked
    );
    let again = push_one(&store, &alpha, 9_000, item("m", &[(&beta, b"w")]));
    assert_eq!(again.status, ItemStatus::Duplicate);
    assert_eq!((again.at_ms, &again.targets), (Some(5_000), &first.targets));
    let fresh = push_one(&store, &alpha, 9_000, item("n", &[(&beta, b"w")]));
    assert_eq!(fresh.status.wire(), "rejected:target not enrolled");

    // Widened to a live fresh target: gamma gets it, beta keeps its original seq.
    let wide = push_one(
        &store,
        &alpha,
        9_500,
        item("m", &[(&beta, b"w"), (&gamma, b"g")]),
    );
    assert_eq!(wide.status, ItemStatus::Accepted);
    assert_eq!(wide.at_ms, Some(9_500));
    assert_eq!(wide.targets[0], first.targets[0]);
    assert_eq!(wide.targets[1].seq, 9_500);
    // A fresh target that is not enrolled still refuses the whole item, before conflict
    // (`wire.md` §3.2 order) and before anything is written.
    let head = store.info_for(&gamma).expect("info").head_seq;
    for (id, targets, want) in [
        (
            "p",
            [(&gamma, "p"), (&stranger, "p")],
            "rejected:target not enrolled",
        ),
        (
            "m",
            [(&beta, "CONFLICT"), (&stranger, "p")],
            "rejected:target not enrolled",
        ),
        (
            "m",
            [(&beta, "CONFLICT"), (&gamma, "g")],
            "rejected:conflict",
        ),
    ] {
        let targets = targets.map(|(t, w)| (t.as_str(), w.as_bytes()));
        let out = push_one(&store, &alpha, 9_600, item(id, &targets));
        assert_eq!(out.status.wire(), want);
    }
    assert_eq!(store.info_for(&gamma).expect("info").head_seq, head);
    assert_eq!(pull_all(&store, &gamma).items.len(), 1);
}

#[test]
fn v1_items_never_expire_and_v2_items_expire_after_retention() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    push_one(&store, &alpha, 1_000, item("v2", &[(&beta, b"x")]));
    store
        .push(crate::testing::conformance::batch(
            &alpha,
            "alpha",
            1_000,
            Expiry::Never,
            vec![item("v1", &[(&beta, b"y")])],
        ))
        .expect("push");
    let expiries: Vec<(String, Option<i64>)> = store
        .read(|c| {
            let mut st = c.prepare("SELECT item_id, expires_at FROM items ORDER BY seq")?;
            let rows = st
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .expect("read");
    assert_eq!(
        expiries,
        [
            ("v2".to_owned(), Some(1_000 + 14 * DAY_MS)),
            ("v1".to_owned(), None)
        ]
    );
}

#[test]
fn a_fresh_target_reports_the_head_before_its_seq_and_a_duplicate_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let gamma = key(3);
    enrol(&store, &gamma, "gamma");
    // Two items in one batch: the second sees the first's seq as beta's head.
    let out = push(
        &store,
        &alpha,
        5_000,
        vec![
            item("m1", &[(&beta, b"one")]),
            item("m2", &[(&beta, b"two"), (&gamma, b"two")]),
        ],
    );
    let (m1, m2) = (&out.items[0], &out.items[1]);
    assert_eq!(m1.prev_seqs, vec![Some(0)]);
    assert_eq!(m2.prev_seqs, vec![Some(m1.targets[0].seq), Some(0)]);
    // A retry: settled by dedup, nothing new stored, nothing to publish.
    let again = push_one(&store, &alpha, 9_000, item("m1", &[(&beta, b"one")]));
    assert_eq!(again.status, ItemStatus::Duplicate);
    assert_eq!(again.prev_seqs, vec![None]);
    // The head moved with the seqs allocated, whatever the clock.
    let m3 = push_one(&store, &alpha, 1, item("m3", &[(&beta, b"three")]));
    assert_eq!(m3.prev_seqs, vec![Some(m2.targets[0].seq)]);
    assert_eq!(m3.targets[0].seq, m2.targets[0].seq + 1);
}
