//! Sweep bounds: dedup pruning past the horizon, batch and prune limits, the relay key check,
//! and a migrated store.

use super::*;

#[test]
fn dedup_rows_are_pruned_past_retention_plus_seven_days_and_not_before() {
    let f = Fixture::new();
    let (alpha, beta) = f.alpha_and_beta();
    f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    f.ack_all(&beta);
    let at = f.sweep(T0 + HORIZON);
    assert_eq!(at.pruned_dedup, 0, "{at:?}");
    assert!(!at.logged);
    assert!(f.dedup_exists(&alpha, "m1", &beta), "kept at the horizon");
    let past = f.sweep(T0 + HORIZON + 1);
    assert_eq!(past.pruned_dedup, 1, "{past:?}");
    assert!(past.logged);
    assert!(!f.dedup_exists(&alpha, "m1", &beta));
    assert_eq!(f.sweep_receipts()[0]["dedup_pruned"], 1);
    // Past the horizon the id is forgotten: a push is new again.
    let again = f.push_as(
        Expiry::Retention,
        &alpha,
        T0 + HORIZON + 2,
        "envelope",
        "m1",
        &beta,
        b"sealed-1",
    );
    assert_eq!(again.status, ItemStatus::Accepted);
}

#[test]
fn the_horizon_follows_the_configured_retention() {
    let f = Fixture::with(StoreLimits {
        retention_days: 2,
        ..StoreLimits::default()
    });
    let (alpha, beta) = f.alpha_and_beta();
    f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    assert_eq!(f.sweep(T0 + 2 * DAY_MS - 1).expired_items, 0);
    assert_eq!(f.sweep(T0 + 2 * DAY_MS).expired_items, 1);
    assert_eq!(f.sweep(T0 + 9 * DAY_MS).pruned_dedup, 0);
    assert_eq!(f.sweep(T0 + 9 * DAY_MS + 1).pruned_dedup, 1);
}

#[test]
fn a_dedup_row_is_never_pruned_while_its_item_is_queued() {
    let f = Fixture::new();
    let (alpha, beta, gamma, gamma2) = (key(1), key(2), key(3), key(4));
    f.enrol(&alpha, "alpha");
    f.enrol(&beta, "beta");
    f.enrol(&gamma, "gamma");
    // v1 items never expire.
    for (id, target) in [("v1-a", &beta), ("v1-b", &gamma)] {
        let out = f.push_as(Expiry::Never, &alpha, T0, "envelope", id, target, b"w");
        assert_eq!(out.status, ItemStatus::Accepted);
    }
    // gamma's item moves to gamma2; its dedup row stays under gamma.
    f.rotate(&gamma, &gamma2, "gamma", T0 + 1);
    let r = f.sweep(T0 + HORIZON + 1);
    assert_eq!((r.expired_items, r.pruned_dedup), (0, 0), "{r:?}");
    assert!(f.dedup_exists(&alpha, "v1-a", &beta));
    assert!(f.dedup_exists(&alpha, "v1-b", &gamma));
    assert_eq!(f.pull(&beta).items.len(), 1);
    assert_eq!(f.pull(&gamma2).items.len(), 1);
    // Once delivered, both go.
    f.ack_all(&beta);
    f.ack_all(&gamma2);
    let r = f.sweep(T0 + HORIZON + 2);
    assert_eq!(r.pruned_dedup, 2, "{r:?}");
}

#[test]
fn the_notice_of_a_rotated_item_names_the_key_the_sender_pushed_to() {
    let f = Fixture::new();
    let (alpha, beta, beta2, beta3) = (key(1), key(2), key(5), key(6));
    f.enrol(&alpha, "alpha");
    f.enrol(&beta, "beta");
    let seq = f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    f.rotate(&beta, &beta2, "beta", T0 + 1_000);
    f.rotate(&beta2, &beta3, "beta", T0 + 2_000);
    assert_eq!(f.pull(&beta3).items.len(), 1, "the item moved twice");
    let r = f.sweep(T0 + RET);
    assert_eq!((r.expired_envelopes, r.notices), (1, 1), "{r:?}");
    assert!(f.pull(&beta3).items.is_empty());
    let page = f.pull(&alpha);
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].item_id, format!("expired:m1:{beta}"));
    let notice = verified_notice(&f.relay_pub(), &page.items[0].wire);
    assert_eq!(notice["target_pubkey"], json!(beta));
    assert_eq!(notice["item_id"], json!("m1"));
    assert_eq!(notice["accepted_at"], json!(iso_ms(T0)));
    // The sender's late retry naming the old key settles with the original seq.
    let retry = f.push_as(
        Expiry::Retention,
        &alpha,
        T0 + RET + 1,
        "envelope",
        "m1",
        &beta,
        b"sealed-1",
    );
    assert_eq!(retry.status, ItemStatus::Duplicate);
    assert_eq!(retry.targets[0].seq, seq);
    assert_eq!(crate::store::assert_usage_matches(&f.raw()), 1);
}

/// Pushes `total` receipts (no notices) from one sender, oldest first (`r0` expires
/// first), spread over targets of at most 500 items each so that the push's quota sums stay
/// small; returns the targets in order. The sweep's batches cut across targets.
fn fill(f: &Fixture, total: usize) -> Vec<String> {
    let alpha = key(1);
    f.enrol(&alpha, "alpha");
    let count = total.div_ceil(SWEEP_BATCH);
    let targets: Vec<String> = (0..count)
        .map(|t| key(100 + u8::try_from(t).expect("few targets")))
        .collect();
    for (t, target) in targets.iter().enumerate() {
        f.enrol(target, &format!("target-{t}"));
    }
    let mut pushed = 0;
    for target in &targets {
        let n = (total - pushed).min(SWEEP_BATCH);
        let items = (pushed..pushed + n)
            .map(|i| {
                crate::testing::conformance::item_of("receipt", &format!("r{i}"), &[(target, b"r")])
            })
            .collect();
        let out = f
            .store
            .push(crate::testing::conformance::batch(
                &alpha,
                "alpha",
                T0 + i64::try_from(pushed).expect("small"),
                Expiry::Retention,
                items,
            ))
            .expect("push");
        assert!(out.items.iter().all(|i| i.status == ItemStatus::Accepted));
        pushed += n;
    }
    assert_eq!(pushed, total);
    targets
}

#[test]
fn batches_are_bounded_to_500_items_each_one_transaction_then_more() {
    let f = Fixture::new();
    let total = SWEEP_BATCH * SWEEP_MAX_BATCHES + 1;
    let targets = fill(&f, total);
    let beta = &targets[20];
    let now = T0 + RET + DAY_MS;
    let before = f.store.commits();
    let r = f.sweep(now);
    assert_eq!(r.expired_items, 10_000, "{r:?}");
    assert_eq!(r.batches, 20);
    assert!(r.more, "one item is left for the next sweep");
    assert!(r.logged);
    assert_eq!(
        f.store.commits() - before,
        21,
        "one transaction per batch of 500, and the last one"
    );
    assert_eq!(f.sweep_receipts()[0]["more"], true);
    for target in &targets[..20] {
        assert!(f.pull(target).items.is_empty());
    }
    let left = f.pull(beta);
    assert_eq!(left.items.len(), 1);
    assert_eq!(left.items[0].item_id, format!("r{}", total - 1));

    let before = f.store.commits();
    let r = f.sweep(now);
    assert_eq!((r.expired_items, r.batches, r.more), (1, 1, false), "{r:?}");
    assert_eq!(f.store.commits() - before, 2);
    assert!(f.pull(beta).items.is_empty());
    assert_eq!(crate::store::assert_usage_matches(&f.raw()), 0);
}

#[test]
fn twenty_full_batches_with_nothing_left_is_not_more() {
    let f = Fixture::new();
    let targets = fill(&f, SWEEP_BATCH * SWEEP_MAX_BATCHES + 1);
    // The last item was accepted at T0 + 10,000, every other one by T0 + 9,500.
    let r = f.sweep(T0 + RET + 9_500);
    assert_eq!(
        (r.expired_items, r.batches, r.more),
        (10_000, 20, false),
        "exactly at the bound: {r:?}"
    );
    assert_eq!(f.pull(&targets[20]).items.len(), 1);
    let r = f.sweep(T0 + RET + 10_000);
    assert_eq!((r.expired_items, r.batches, r.more), (1, 1, false), "{r:?}");
}

#[test]
fn pruning_exactly_its_bound_is_not_more() {
    let f = Fixture::new();
    let targets = fill(&f, SWEEP_MAX_PRUNE + 1);
    for target in &targets {
        f.ack_all(target);
    }
    // r10000 (accepted at T0 + 10,000) is not past the horizon yet.
    let r = f.sweep(T0 + HORIZON + 10_000);
    assert_eq!((r.pruned_dedup, r.more), (10_000, false), "{r:?}");
    let r = f.sweep(T0 + HORIZON + 10_001);
    assert_eq!((r.pruned_dedup, r.more), (1, false), "{r:?}");
}

#[test]
fn pruning_is_bounded_per_sweep_then_more() {
    let f = Fixture::new();
    let total = SWEEP_MAX_PRUNE + 1;
    let targets = fill(&f, total);
    for target in &targets {
        f.ack_all(target);
    }
    // Every row is past the horizon; r0 oldest.
    let now = T0 + HORIZON + DAY_MS;
    let r = f.sweep(now);
    assert_eq!(
        (r.expired_items, r.pruned_dedup, r.batches, r.more),
        (0, 10_000, 1, true),
        "{r:?}"
    );
    let left: i64 = f
        .raw()
        .query_row("SELECT COUNT(*) FROM dedup", [], |row| row.get(0))
        .expect("count");
    assert_eq!(left, 1);
    assert!(f.dedup_exists(&key(1), &format!("r{}", total - 1), &targets[20]));
    let r = f.sweep(now);
    assert_eq!((r.pruned_dedup, r.more), (1, false), "{r:?}");
}

#[test]
fn a_signer_of_another_key_is_refused_and_changes_nothing() {
    let f = Fixture::new();
    let (alpha, beta) = f.alpha_and_beta();
    f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    let other: Arc<dyn NoticeSigner> = Arc::new(RelayNoticeSigner::new(HostKey::generate()));
    let e = f.store.sweep(T0 + RET, other).expect_err("refused");
    assert!(matches!(e, StoreError::InvalidInput(_)), "{e:?}");
    assert_eq!(f.pull(&beta).items.len(), 1);
}

#[test]
fn a_version_2_store_with_a_moved_item_migrates_and_its_notice_names_the_old_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let relay = HostKey::generate();
    let (alpha, beta, beta2) = (key(1), key(2), key(5));
    {
        let mut c = Connection::open(dir.path().join(DB_FILE)).expect("open v2");
        crate::store::migrate(&mut c, 0, 2, crate::store::MIGRATIONS).expect("to v2");
        c.execute_batch("INSERT INTO meta (k, v) VALUES ('epoch', 'epoch-v2')")
            .expect("epoch");
        c.execute(
            "INSERT INTO meta (k, v) VALUES ('relay_pubkey', ?1)",
            [relay.public().to_b64()],
        )
        .expect("relay key");
        for (k, name, revoked) in [(&alpha, "alpha", None), (&beta, "beta", Some(T0 + 5))]
            .into_iter()
            .chain([(&beta2, "beta", None)])
        {
            c.execute(
                "INSERT INTO enrolments (host_pubkey, host_name, owner_fp, account,
                   authorized_by, authority_rank, enrolled_at, revoked_at)
                 VALUES (?1, ?2, '', NULL, 'host-key-challenge', 0, ?3, ?4)",
                params![k, name, T0, revoked],
            )
            .expect("enrolment");
        }
        // m1 was pushed to beta (seq 3) and a rotation moved it to beta2 (seq 9); m2 was
        // pushed to beta2 itself.
        let item = |target: &str, seq: i64, id: &str, wire: &[u8]| {
            c.execute(
                "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey,
                   sender_host, wire, wire_hash, bytes, accepted_at, expires_at)
                 VALUES (?1, ?2, 'envelope', ?3, ?4, 'alpha', ?5, ?6, ?7, ?8, ?9)",
                params![
                    target,
                    seq,
                    id,
                    alpha,
                    wire,
                    wire_hash(wire),
                    wire.len() as i64,
                    T0,
                    T0 + RET
                ],
            )
            .expect("item");
        };
        item(&beta2, 9, "m1", b"sealed-1");
        item(&beta2, 10, "m2", b"sealed-2");
        let dedup = |target: &str, seq: i64, id: &str, wire: &[u8]| {
            c.execute(
                "INSERT INTO dedup (sender_pubkey, item_id, target_pubkey, wire_hash, seq,
                   accepted_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![alpha, id, target, wire_hash(wire), seq, T0],
            )
            .expect("dedup");
        };
        dedup(&beta, 3, "m1", b"sealed-1");
        dedup(&beta2, 10, "m2", b"sealed-2");
        c.execute(
            "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, 11)",
            [&beta2],
        )
        .expect("seqs");
    }
    let store = open(dir.path(), &relay, StoreLimits::default());
    assert_eq!(
        store.epoch().expect("epoch"),
        "epoch-v2",
        "the epoch is kept"
    );
    {
        let raw =
            Connection::open_with_flags(dir.path().join(DB_FILE), OpenFlags::SQLITE_OPEN_READ_ONLY)
                .expect("raw");
        assert_eq!(
            crate::store::stored_version(&raw).expect("version"),
            crate::store::SCHEMA_VERSION
        );
        let origin = |id: &str| -> Option<String> {
            raw.query_row(
                "SELECT origin_target FROM items WHERE item_id = ?1",
                [id],
                |r| r.get(0),
            )
            .optional()
            .expect("query")
            .flatten()
        };
        assert_eq!(origin("m1"), Some(beta.clone()), "backfilled from dedup");
        assert_eq!(origin("m2"), None);
        let n: i64 = raw
            .query_row("SELECT COUNT(*) FROM dedup", [], |r| r.get(0))
            .expect("count");
        assert_eq!(n, 2, "every dedup row kept");
    }
    let signer: Arc<dyn NoticeSigner> = Arc::new(RelayNoticeSigner::new(relay.clone()));
    let r = store.sweep(T0 + RET, signer).expect("sweep");
    assert_eq!((r.expired_envelopes, r.notices), (2, 2), "{r:?}");
    let ids: Vec<String> = store
        .pull(crate::testing::conformance::pull_everything(&alpha))
        .expect("pull")
        .items
        .into_iter()
        .map(|i| i.item_id)
        .collect();
    assert_eq!(
        ids,
        vec![format!("expired:m1:{beta}"), format!("expired:m2:{beta2}")]
    );
}
