//! Pull pages and acks.

use super::*;

#[test]
fn paging_by_count_and_by_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let sizes = [10usize, 10, 50, 10, 10];
    let mut seqs = Vec::new();
    for (i, n) in sizes.iter().enumerate() {
        let wire = vec![b'a' + i as u8; *n];
        let o = push_one(
            &store,
            &alpha,
            1_000,
            item(&format!("m{i}"), &[(&beta, &wire)]),
        );
        seqs.push(o.targets[0].seq);
    }
    let pull = |after: i64, limit: i64, max_bytes: u64| {
        store
            .pull(PullRequest {
                target_pubkey: beta.clone(),
                after,
                limit,
                max_bytes,
            })
            .expect("pull")
    };

    // By count.
    let p = pull(0, 2, u64::MAX);
    assert_eq!(p.items.iter().map(|i| i.seq).collect::<Vec<_>>(), seqs[..2]);
    assert_eq!(p.last_seq, seqs[1]);
    assert!(p.more);
    assert_eq!(p.head_seq, seqs[4]);
    assert_eq!(p.items[0].item_id, "m0");
    assert_eq!(p.items[0].sender_pubkey, alpha);
    assert_eq!(p.items[0].sender_host, "alpha");
    assert_eq!(p.items[0].kind, "envelope");
    assert_eq!(p.items[0].wire, vec![b'a'; 10]);

    // A limit of 0 or less still returns one item; a huge one is clamped.
    assert_eq!(pull(0, 0, u64::MAX).items.len(), 1);
    assert_eq!(pull(0, 10_000, u64::MAX).items.len(), 5);

    // By bytes: 10 + 10 fit in 25, the next (50) would exceed.
    let p = pull(0, 500, 25);
    assert_eq!(p.items.len(), 2);
    assert!(p.more);
    assert_eq!(p.last_seq, seqs[1]);
    // An item larger than the budget comes alone.
    let p = pull(seqs[1], 500, 25);
    assert_eq!(p.items.len(), 1);
    assert_eq!(p.items[0].wire.len(), 50);
    assert_eq!(p.last_seq, seqs[2]);
    assert!(p.more);
    // Exactly at the budget fits.
    let p = pull(seqs[2], 500, 20);
    assert_eq!(p.items.len(), 2);
    assert!(!p.more, "nothing after the last item");
    assert_eq!(p.last_seq, seqs[4]);
    // Past the end: empty, last_seq = after.
    let p = pull(seqs[4], 500, 25);
    assert!(p.items.is_empty());
    assert_eq!(p.last_seq, seqs[4]);
    assert!(!p.more);
    // A host with no queue at all.
    let p = pull_all(&store, &key(77));
    assert_eq!((p.head_seq, p.last_seq, p.more), (0, 0, false));
    assert_eq!(p.epoch, store.epoch().expect("epoch"));
}

#[test]
fn ack_deletes_through_refuses_beyond_head_and_never_goes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    for i in 0..5 {
        push_one(
            &store,
            &alpha,
            100,
            item(&format!("m{i}"), &[(&beta, b"w")]),
        );
    }
    // seqs 100..=104
    let ack = |through: i64, epoch: Option<String>| {
        store
            .ack(AckRequest {
                target_pubkey: beta.clone(),
                through,
                epoch,
            })
            .expect("ack")
    };
    let epoch = store.epoch().expect("epoch");
    match ack(102, Some(epoch.clone())) {
        AckResult::Acked(a) => {
            assert_eq!(a.acked_through, 102);
            assert_eq!(a.deleted, 3);
            assert_eq!(a.head_seq, 104);
            assert_eq!(a.epoch, epoch);
        }
        other => panic!("unexpected {other:?}"),
    }
    let left: Vec<i64> = pull_all(&store, &beta)
        .items
        .iter()
        .map(|i| i.seq)
        .collect();
    assert_eq!(left, [103, 104]);
    assert_eq!(
        usage_matches(dir.path()),
        2,
        "the ack's deletes are counted"
    );

    assert_eq!(
        ack(105, None),
        AckResult::OutOfRange {
            head_seq: 104,
            epoch: epoch.clone()
        }
    );
    assert_eq!(pull_all(&store, &beta).items.len(), 2, "nothing deleted");

    // An older ack is harmless and does not move acked_through back.
    match ack(101, None) {
        AckResult::Acked(a) => {
            assert_eq!((a.acked_through, a.deleted), (102, 0));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(store.info_for(&beta).expect("info").acked_through, 102);

    assert_eq!(
        ack(104, Some("another-epoch".to_owned())),
        AckResult::StaleEpoch {
            epoch: epoch.clone(),
            head_seq: 104
        }
    );
    assert_eq!(
        pull_all(&store, &beta).items.len(),
        2,
        "stale epoch changes nothing"
    );

    // Through 0 on an empty queue is fine; below 0 is out of range like past the head
    // (wire.md §3.2), whatever the i64, and changes nothing.
    assert!(matches!(
        store.ack(AckRequest {
            target_pubkey: key(50),
            through: 0,
            epoch: None
        }),
        Ok(AckResult::Acked(_))
    ));
    for through in [-1, i64::MIN, i64::MAX] {
        assert_eq!(
            ack(through, None),
            AckResult::OutOfRange {
                head_seq: 104,
                epoch: epoch.clone()
            }
        );
    }
    assert_eq!(pull_all(&store, &beta).items.len(), 2, "nothing deleted");
    match ack(104, None) {
        AckResult::Acked(a) => assert_eq!((a.acked_through, a.deleted), (104, 2)),
        other => panic!("unexpected {other:?}"),
    }
    let info = store.info_for(&beta).expect("info");
    assert_eq!((info.head_seq, info.acked_through), (104, 104));
    assert_eq!(usage_matches(dir.path()), 0);
}
