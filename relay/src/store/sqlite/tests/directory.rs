//! Enrolments, revocation, names, enc-key ads and sender allowlists.

use super::*;

#[test]
fn a_sender_allowlist_refuses_other_senders() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let mallory = key(6);
    enrol(&store, &mallory, "mallory");
    let list = |iat_ms: i64, senders: Vec<String>| SenderList {
        target_pubkey: beta.clone(),
        senders,
        iat_ms,
        record: format!("{{\"iat\":{iat_ms}}}"),
        sig: "sig".to_owned(),
    };
    // No list: everybody may push.
    assert_eq!(
        pushed(&store, &mallory, 1, "m0", &beta, b"x"),
        ItemStatus::Accepted
    );
    assert_eq!(
        store
            .put_sender_list(list(100, vec![alpha.clone(), alpha.clone()]))
            .expect("put"),
        SenderListOutcome::Stored
    );
    assert_eq!(
        store
            .sender_list(&beta)
            .expect("get")
            .expect("stored")
            .senders,
        vec![alpha.clone()],
        "duplicates dropped"
    );
    assert_eq!(
        pushed(&store, &mallory, 1, "m1", &beta, b"x").wire(),
        "rejected:sender not accepted by target"
    );
    assert_eq!(
        pushed(&store, &alpha, 1, "a1", &beta, b"x"),
        ItemStatus::Accepted
    );
    // Same or older iat: stale, nothing changes.
    assert_eq!(
        store
            .put_sender_list(list(100, vec![mallory.clone()]))
            .expect("put"),
        SenderListOutcome::Stale
    );
    assert_eq!(
        store
            .put_sender_list(list(99, vec![mallory.clone()]))
            .expect("put"),
        SenderListOutcome::Stale
    );
    assert_eq!(
        pushed(&store, &mallory, 1, "m2", &beta, b"x").wire(),
        "rejected:sender not accepted by target"
    );
    // Newer: replaces.
    assert_eq!(
        store
            .put_sender_list(list(101, vec![mallory.clone()]))
            .expect("put"),
        SenderListOutcome::Stored
    );
    assert_eq!(
        pushed(&store, &mallory, 1, "m3", &beta, b"x"),
        ItemStatus::Accepted
    );
    let stored = store.sender_list(&beta).expect("get").expect("stored");
    assert_eq!(
        (stored.iat_ms, stored.record.as_str()),
        (101, "{\"iat\":101}")
    );
}

#[test]
fn a_revoked_key_stays_revoked_and_serves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    store
        .put_enc_ad_v1(EncAdV1 {
            host_pubkey: beta.clone(),
            host_name: "beta".to_owned(),
            enc_pub: "E1".to_owned(),
            sig: "s1".to_owned(),
            at_ms: 1,
        })
        .expect("ad");
    assert!(store.get_enc_ad(&beta).expect("ad").is_some());
    assert_eq!(
        store.revoke(&beta, 2_000).expect("revoke"),
        RevokeOutcome::Revoked
    );
    assert_eq!(
        store.revoke(&beta, 3_000).expect("revoke"),
        RevokeOutcome::AlreadyRevoked
    );
    assert_eq!(
        store.revoke(&key(99), 3_000).expect("revoke"),
        RevokeOutcome::Unknown
    );
    assert_eq!(
        enrol_as(&store, &beta, "beta", Some("acct")),
        EnrolOutcome::Revoked
    );
    let row = store.enrolment(&beta).expect("row").expect("known");
    assert_eq!(
        row.revoked_at_ms,
        Some(2_000),
        "the first revocation time is kept"
    );
    assert_eq!(store.get_enc_ad(&beta).expect("ad"), None);
    assert_eq!(
        pushed(&store, &alpha, 1, "m", &beta, b"x").wire(),
        "rejected:target not enrolled"
    );
    assert!(store
        .live_enrolments_by_name("BETA")
        .expect("by name")
        .is_empty());
    assert_eq!(store.live_enrolment_count().expect("count"), 1);
}

#[test]
fn names_are_unique_per_account_case_insensitively_and_weaker_authority_keeps_the_account() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_limited(
        dir.path(),
        StoreLimits {
            max_live_enrolments: 4,
            ..StoreLimits::default()
        },
    );
    let (k1, k2, k3, k4, k5) = (key(1), key(2), key(3), key(4), key(5));
    assert!(matches!(
        enrol_as(&store, &k1, "MacBook", Some("acct-1")),
        EnrolOutcome::Enrolled(_)
    ));
    assert_eq!(
        enrol_as(&store, &k2, "macbook", Some("acct-1")),
        EnrolOutcome::NameTaken
    );
    // Another account, or no account at all, may use the name.
    assert!(matches!(
        enrol_as(&store, &k2, "macbook", Some("acct-2")),
        EnrolOutcome::Enrolled(_)
    ));
    assert!(matches!(
        enrol_as(&store, &k3, "MACBOOK", None),
        EnrolOutcome::Enrolled(_)
    ));
    assert_eq!(
        store
            .live_enrolments_by_name("macBook")
            .expect("by name")
            .len(),
        3
    );

    // The host-key challenge re-enrols k1: name and owner_fp refresh, account stays.
    let weaker = store
        .enrol(EnrolRequest {
            owner_fp: "claimed".to_owned(),
            ..enrol_request_at(&k1, "macbook", None, 5_000)
        })
        .expect("enrol");
    match weaker {
        EnrolOutcome::Enrolled(e) => {
            assert_eq!(e.account.as_deref(), Some("acct-1"));
            assert_eq!(e.authorized_by, "account-token");
            assert_eq!(e.strength, AuthorityStrength::Account);
            assert_eq!(
                (e.host_name.as_str(), e.owner_fp.as_str()),
                ("macbook", "claimed")
            );
            assert_eq!(e.enrolled_at_ms, 5_000);
        }
        other => panic!("unexpected {other:?}"),
    }
    // A stronger authority upgrades a challenge-only enrolment.
    match enrol_as(&store, &k3, "macbook-3", Some("acct-1")) {
        EnrolOutcome::Enrolled(e) => assert_eq!(e.account.as_deref(), Some("acct-1")),
        other => panic!("unexpected {other:?}"),
    }
    // Capacity: 4 live at most; a new key is refused, a known one re-enrols.
    assert!(matches!(
        enrol_as(&store, &k4, "four", None),
        EnrolOutcome::Enrolled(_)
    ));
    assert_eq!(enrol_as(&store, &k5, "five", None), EnrolOutcome::Full);
    assert!(matches!(
        enrol_as(&store, &k4, "four", None),
        EnrolOutcome::Enrolled(_)
    ));
    assert_eq!(
        store.revoke(&k4, 9).expect("revoke"),
        RevokeOutcome::Revoked
    );
    assert!(matches!(
        enrol_as(&store, &k5, "five", None),
        EnrolOutcome::Enrolled(_)
    ));
    // A name freed by revocation can be taken in the account.
    assert_eq!(
        store.revoke(&k1, 10).expect("revoke"),
        RevokeOutcome::Revoked
    );
    match enrol_as(&store, &k2, "MacBook", Some("acct-1")) {
        EnrolOutcome::Enrolled(e) => {
            assert_eq!(
                (e.host_name.as_str(), e.account.as_deref()),
                ("MacBook", Some("acct-1"))
            );
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn enc_ads_serve_the_v2_key_and_a_matching_v1_signature() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let beta = key(2);
    assert_eq!(store.get_enc_ad(&beta).expect("ad"), None, "unknown host");
    enrol(&store, &beta, "beta");
    assert_eq!(store.get_enc_ad(&beta).expect("ad"), None, "no ad yet");
    let v1 = EncAdV1 {
        host_pubkey: beta.clone(),
        host_name: "beta".to_owned(),
        enc_pub: "E1".to_owned(),
        sig: "s1".to_owned(),
        at_ms: 1,
    };
    store.put_enc_ad_v1(v1.clone()).expect("v1");
    let ad = store.get_enc_ad(&beta).expect("ad").expect("served");
    assert_eq!(
        (ad.enc_pub.as_str(), ad.v1.as_ref(), ad.v2.as_ref()),
        ("E1", Some(&v1), None)
    );
    // A v2 record naming the same key: both served.
    let v2 = EncAdV2 {
        host_pubkey: beta.clone(),
        enc_pub: "E1".to_owned(),
        record: "{\"enc_pub\":\"E1\"}".to_owned(),
        sig: "s2".to_owned(),
        at_ms: 2,
    };
    store.put_enc_ad_v2(v2.clone()).expect("v2");
    let ad = store.get_enc_ad(&beta).expect("ad").expect("served");
    assert_eq!((ad.v1.as_ref(), ad.v2.as_ref()), (Some(&v1), Some(&v2)));
    // A newer v2 record with another key: the stale v1 ad is no longer served.
    let v2b = EncAdV2 {
        enc_pub: "E2".to_owned(),
        record: "{\"enc_pub\":\"E2\"}".to_owned(),
        at_ms: 3,
        ..v2
    };
    store.put_enc_ad_v2(v2b.clone()).expect("v2b");
    let ad = store.get_enc_ad(&beta).expect("ad").expect("served");
    assert_eq!(ad.enc_pub, "E2");
    assert_eq!(ad.v1, None);
    assert_eq!(ad.v2, Some(v2b));
    assert_eq!(ad.host_name, "beta");
}

#[test]
fn only_canonical_host_keys_are_enrolled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let canonical = key(1);
    let alias = canonical.trim_end_matches('=').to_owned();
    assert_ne!(alias, canonical);
    let err = store
        .enrol(enrol_request_at(&alias, "alpha", None, 1_000))
        .expect_err("an alias is refused");
    assert!(matches!(err, StoreError::InvalidInput(_)), "{err}");
    assert_eq!(store.live_enrolment_count().expect("count"), 0);
    enrol(&store, &canonical, "alpha");
    assert_eq!(store.live_enrolment_count().expect("count"), 1);
}

#[test]
fn a_name_lookup_loads_at_most_the_crowded_threshold_plus_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    for n in 1..=20u8 {
        enrol(&store, &key(n), "MacBook");
    }
    let found = store.live_enrolments_by_name("macbook").expect("by name");
    assert_eq!(found.len(), crate::store::MAX_LIVE_BY_NAME);
    // Newest first: the last 17 enrolled.
    let keys: Vec<String> = found.into_iter().map(|e| e.host_pubkey).collect();
    let want: Vec<String> = (4..=20u8).rev().map(key).collect();
    assert_eq!(keys, want);
    // At the bound exactly all are returned.
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    for n in 1..=17u8 {
        enrol(&store, &key(n), "pi");
    }
    assert_eq!(
        store.live_enrolments_by_name("PI").expect("by name").len(),
        17
    );
}
