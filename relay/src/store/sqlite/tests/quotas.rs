//! Quotas and the push path's prepared statements.

use super::*;

#[test]
fn quotas_hold_at_the_bound_and_refuse_past_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_limited(dir.path(), quota_limits());
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    enrol(&store, &alpha, "alpha");
    enrol(&store, &beta, "Beta");
    enrol(&store, &gamma, "gamma");

    // An item from `sender` to beta, at 1.
    let to_beta = |sender: &str, id: &str, wire: &[u8]| pushed(&store, sender, 1, id, &beta, wire);
    // Sender share: 2 items from alpha fit, the 3rd does not.
    assert_eq!(to_beta(&alpha, "a1", &[1; 10]), ItemStatus::Accepted);
    assert_eq!(to_beta(&alpha, "a2", &[2; 10]), ItemStatus::Accepted);
    assert_eq!(
        to_beta(&alpha, "a3", &[3; 1]).wire(),
        "rejected:quota:sender share exceeded for Beta"
    );
    // A duplicate is never charged, even at the bound.
    assert_eq!(to_beta(&alpha, "a2", &[2; 10]), ItemStatus::Duplicate);
    // Queue bytes: 20 used, 10 more is exactly 30 (fits), then 1 more does not.
    assert_eq!(to_beta(&gamma, "g1", &[4; 10]), ItemStatus::Accepted);
    assert_eq!(pull_all(&store, &beta).items.len(), 3);
    // Queue depth: 3 items queued = the bound; one more is refused (depth is checked first).
    assert_eq!(
        to_beta(&gamma, "g2", &[5; 1]).wire(),
        "rejected:quota:queue depth exceeded for Beta"
    );
    // Free one slot: now bytes are the binding limit (20 + 11 > 30).
    let acked = store
        .ack(AckRequest {
            target_pubkey: beta.clone(),
            through: pull_all(&store, &beta).items[0].seq,
            epoch: None,
        })
        .expect("ack");
    assert!(matches!(acked, AckResult::Acked(_)));
    assert_eq!(
        to_beta(&gamma, "g3", &[6; 11]).wire(),
        "rejected:quota:queue bytes exceeded for Beta"
    );
    assert_eq!(to_beta(&gamma, "g4", &[7; 10]), ItemStatus::Accepted);
    assert_eq!(pull_all(&store, &beta).items.len(), 3);
    assert_eq!(
        usage_matches(dir.path()),
        3,
        "refused items are never counted"
    );
}

/// Two items per account.
fn owner_limits() -> StoreLimits {
    StoreLimits {
        max_owner_items: 2,
        ..StoreLimits::default()
    }
}

/// Enrols `alpha` (no account), then `b1` as "one" and `b2` as "two" in account "acct".
fn enrol_alpha_and_account(store: &SqliteStore, alpha: &str, b1: &str, b2: &str) {
    enrol(store, alpha, "alpha");
    for (k, name) in [(b1, "one"), (b2, "two")] {
        let out = enrol_as(store, k, name, Some("acct"));
        assert!(matches!(out, EnrolOutcome::Enrolled(_)));
    }
}

#[test]
fn account_quota_charges_only_proven_accounts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_limited(dir.path(), owner_limits());
    let (alpha, b1, b2, loose) = (key(1), key(2), key(3), key(4));
    enrol_alpha_and_account(&store, &alpha, &b1, &b2);
    enrol(&store, &loose, "loose");
    // One byte from alpha to `target`, at `now`.
    let x_to = |now: i64, id: &str, target: &str| pushed(&store, &alpha, now, id, target, b"x");
    assert_eq!(x_to(1, "1", &b1), ItemStatus::Accepted);
    assert_eq!(x_to(1, "2", &b2), ItemStatus::Accepted);
    assert_eq!(
        x_to(1, "3", &b2).wire(),
        "rejected:quota:owner queue depth exceeded for two"
    );
    for i in 0..3 {
        let o = x_to(1, &format!("l{i}"), &loose);
        assert_eq!(o, ItemStatus::Accepted, "no account, no account quota");
    }
    // A revoked key's queue no longer counts for its account (its items stay queued).
    assert_eq!(
        store.revoke(&b2, 2).expect("revoke"),
        RevokeOutcome::Revoked
    );
    assert_eq!(x_to(3, "4", &b1), ItemStatus::Accepted);
    assert_eq!(
        x_to(3, "5", &b1).wire(),
        "rejected:quota:owner queue depth exceeded for one"
    );
    assert_eq!(usage_matches(dir.path()), 6);
}

#[test]
fn account_quota_counts_the_items_own_earlier_targets() {
    // One item to two targets of the same account, with room for one more item in the
    // account: the second target sees the first target's addition and the whole item is
    // refused, with nothing stored for either target.
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_limited(dir.path(), owner_limits());
    let (alpha, b1, b2) = (key(1), key(2), key(3));
    enrol_alpha_and_account(&store, &alpha, &b1, &b2);
    assert_eq!(
        pushed(&store, &alpha, 1, "1", &b1, b"x"),
        ItemStatus::Accepted
    );
    assert_eq!(
        push_one(&store, &alpha, 1, item("2", &[(&b1, b"y"), (&b2, b"y")]))
            .status
            .wire(),
        "rejected:quota:owner queue depth exceeded for two"
    );
    assert_eq!(pull_all(&store, &b1).items.len(), 1);
    assert!(pull_all(&store, &b2).items.is_empty());
    assert_eq!(
        usage_matches(dir.path()),
        1,
        "a refused item counts nowhere"
    );
    // The refused item took no room: one more item fits the account.
    assert_eq!(
        pushed(&store, &alpha, 1, "3", &b2, b"z"),
        ItemStatus::Accepted
    );
    assert_eq!(usage_matches(dir.path()), 2);
}

#[test]
fn the_push_path_reuses_its_prepared_statements() {
    // Every statement of a push is prepared once per connection: a statement SQLite
    // re-prepares on each run (as a `json_each` joined to a table was) costs a full parse.
    let dir = tempfile::tempdir().expect("tempdir");
    let (alpha, beta, listed) = (key(1), key(2), key(3));
    {
        let store = open(dir.path());
        for (k, name) in [(&alpha, "alpha"), (&beta, "beta"), (&listed, "listed")] {
            enrol(&store, k, name);
        }
        let out = store
            .put_sender_list(SenderList {
                target_pubkey: listed.clone(),
                senders: vec![alpha.clone()],
                iat_ms: 1,
                record: "{}".to_owned(),
                sig: "sig".to_owned(),
            })
            .expect("list");
        assert_eq!(out, SenderListOutcome::Stored);
        store.close().expect("close");
    }
    let c = open_write_connection(&dir.path().join(DB_FILE)).expect("open");
    for i in 0..10 {
        let batch = crate::testing::conformance::batch(
            &alpha,
            "alpha",
            10 + i,
            Expiry::Retention,
            vec![
                item(&format!("a{i}"), &[(&beta, b"one")]),
                item(&format!("b{i}"), &[(&listed, b"two")]),
            ],
        );
        run_cached(&c, "BEGIN IMMEDIATE").expect("begin");
        let out = push_apply(&c, &StoreLimits::default(), &batch).expect("push");
        run_cached(&c, "COMMIT").expect("commit");
        assert!(out.items.iter().all(|o| o.status == ItemStatus::Accepted));
    }
    let st = c.prepare_cached(SENDER_ALLOWED_SQL).expect("cached");
    assert_eq!(
        st.get_status(rusqlite::StatementStatus::RePrepare),
        0,
        "the allowlist check was prepared again"
    );
    assert!(
        st.get_status(rusqlite::StatementStatus::VmStep) > 0,
        "it ran"
    );
}
