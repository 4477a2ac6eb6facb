//! Rules of the directory (spec §2 enrolments, enc_ads, sender allowlist, rotation; §8
//! authorities, revocation and the deny list).

use base64::Engine as _;

use crate::store::{
    AccountBinding, AuthorityStrength, DenyEntry, DenyKind, DenyOutcome, EncAdV1, EncAdV2,
    EnrolOutcome, ItemStatus, RevokeOutcome, RotateOutcome, RotateRequest, SenderList,
    SenderListOutcome, StoreError, StoreLimits,
};

use super::{enrol_request, item, key, Factory, Store, T0};

/// The display fingerprint of host key `k` (`wire.md` §2.1; what host deny entries are keyed
/// by).
fn fingerprint(k: &str) -> String {
    let raw = base64::engine::general_purpose::STANDARD
        .decode(k)
        .expect("a host key");
    agentmbx_protocol::keys::fingerprint(&raw)
}

/// A sender list of `target` naming `senders`, issued at `iat_ms`.
pub(crate) fn list(target: &str, senders: &[&str], iat_ms: i64) -> SenderList {
    SenderList {
        target_pubkey: target.to_owned(),
        senders: senders.iter().map(|s| (*s).to_owned()).collect(),
        iat_ms,
        record: format!("{{\"signed-by\":\"{target}\",\"iat\":{iat_ms}}}"),
        sig: format!("sig-of-{target}"),
    }
}

/// A rotation from `old` to `new` of host `host` at `now_ms`.
pub(crate) fn rotation(old: &str, new: &str, host: &str, now_ms: i64) -> RotateRequest {
    RotateRequest {
        old_pubkey: old.to_owned(),
        new_pubkey: new.to_owned(),
        host_name: host.to_owned(),
        now_ms,
    }
}

/// Spec §8 "Re-enrolling the same host key is idempotent"; §2: a name is a label, so keys
/// without a proven account may share one, and names match case-insensitively.
pub fn re_enrolment_is_idempotent_and_names_are_labels(make: &Factory) {
    let st = Store::open(make);
    let (a, b) = (key(1), key(2));
    st.enrol(&a, "MacBook");
    st.enrol(&a, "MacBook");
    st.enrol(&b, "macbook");
    assert_eq!(st.s.live_enrolment_count().expect("count"), 2);
    let found = st.s.live_enrolments_by_name("MACBOOK").expect("by name");
    let mut keys: Vec<String> = found.into_iter().map(|e| e.host_pubkey).collect();
    keys.sort();
    assert_eq!(keys, [a.clone(), b.clone()]);
    let row = st.s.enrolment(&a).expect("read").expect("enrolled");
    assert_eq!(
        (
            row.host_name.as_str(),
            row.revoked_at_ms,
            row.enrolled_at_ms
        ),
        ("MacBook", None, T0)
    );
    assert_eq!(st.s.enrolment(&key(9)).expect("read"), None);
}

/// Spec §2: a name is unique among the live hosts of one proven account (case-insensitively);
/// another account, or no account, may carry it.
pub fn names_are_unique_inside_a_proven_account(make: &Factory) {
    let st = Store::open(make);
    let (k1, k2, k3) = (key(1), key(2), key(3));
    assert!(matches!(
        st.enrol_as(&k1, "MacBook", Some("acct-1")),
        EnrolOutcome::Enrolled(_)
    ));
    assert_eq!(
        st.enrol_as(&k2, "macbook", Some("acct-1")),
        EnrolOutcome::NameTaken
    );
    assert_eq!(st.s.enrolment(&k2).expect("read"), None, "nothing written");
    assert!(matches!(
        st.enrol_as(&k2, "macbook", Some("acct-2")),
        EnrolOutcome::Enrolled(_)
    ));
    assert!(matches!(
        st.enrol_as(&k3, "MACBOOK", None),
        EnrolOutcome::Enrolled(_)
    ));
    // Once the holder is revoked, the name is free in its account.
    st.s.revoke(&k1, T0 + 1).expect("revoke");
    assert!(matches!(
        st.enrol_as(&key(4), "macbook", Some("acct-1")),
        EnrolOutcome::Enrolled(_)
    ));
}

/// Spec §2: a weaker authority (the host-key challenge) never overwrites the account or
/// `authorized_by` a stronger one recorded; a stronger one upgrades a weaker enrolment.
pub fn a_weaker_authority_keeps_the_stronger_account(make: &Factory) {
    let st = Store::open(make);
    let (k1, k2) = (key(1), key(2));
    st.enrol_as(&k1, "mac", Some("acct-1"));
    let mut weaker = enrol_request(&k1, "mac-renamed", None);
    weaker.owner_fp = "claimed".to_owned();
    weaker.now_ms = T0 + 5_000;
    match st.s.enrol(weaker).expect("enrol") {
        EnrolOutcome::Enrolled(e) => {
            assert_eq!(
                (e.account.as_deref(), e.authorized_by.as_str(), e.strength),
                (Some("acct-1"), "account-token", AuthorityStrength::Account)
            );
            assert_eq!(
                (e.host_name.as_str(), e.owner_fp.as_str(), e.enrolled_at_ms),
                ("mac-renamed", "claimed", T0 + 5_000)
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    st.enrol(&k2, "two");
    match st.enrol_as(&k2, "two", Some("acct-1")) {
        EnrolOutcome::Enrolled(e) => {
            assert_eq!(e.account.as_deref(), Some("acct-1"));
            assert_eq!(e.strength, AuthorityStrength::Account);
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// `wire.md` §3.2 "Enrolment": at the live-enrolment cap a new key is refused (FULL), a known
/// one re-enrols, and a revocation frees a place.
pub fn the_live_enrolment_cap_refuses_only_new_keys(make: &Factory) {
    let st = Store::open_limited(
        make,
        StoreLimits {
            max_live_enrolments: 2,
            ..StoreLimits::default()
        },
    );
    st.enrol(&key(1), "one");
    st.enrol(&key(2), "two");
    assert_eq!(st.enrol_as(&key(3), "three", None), EnrolOutcome::Full);
    assert_eq!(st.s.enrolment(&key(3)).expect("read"), None);
    st.enrol(&key(1), "one");
    st.s.revoke(&key(2), T0).expect("revoke");
    st.enrol(&key(3), "three");
    assert_eq!(st.s.live_enrolment_count().expect("count"), 2);
}

/// `wire.md` §2.1: the store keys hosts by the one canonical text of their key and refuses
/// any other (an unpadded alias would be a second identity).
pub fn only_canonical_host_keys_are_enrolled(make: &Factory) {
    let st = Store::open(make);
    let canonical = key(1);
    let alias = canonical.trim_end_matches('=').to_owned();
    let err =
        st.s.enrol(enrol_request(&alias, "alpha", None))
            .expect_err("an alias is refused");
    assert!(matches!(err, StoreError::InvalidInput(_)), "{err}");
    assert_eq!(st.s.live_enrolment_count().expect("count"), 0);
    st.enrol(&canonical, "alpha");
}

/// Spec §2: a revoked key stays revoked — re-enrolment (even by a stronger authority) answers
/// `Revoked`, the first revocation time is kept, it receives nothing, serves no enc key and
/// no name lookup finds it.
pub fn revocation_sticks(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta) = st.alpha_and_beta();
    assert_eq!(
        st.s.revoke(&beta, T0 + 2).expect("revoke"),
        RevokeOutcome::Revoked
    );
    assert_eq!(
        st.s.revoke(&beta, T0 + 3).expect("revoke"),
        RevokeOutcome::AlreadyRevoked
    );
    assert_eq!(
        st.s.revoke(&key(99), T0).expect("revoke"),
        RevokeOutcome::Unknown
    );
    assert_eq!(
        st.s.enrolment(&key(99)).expect("read"),
        None,
        "nothing written"
    );
    assert_eq!(st.enrol_as(&beta, "beta", None), EnrolOutcome::Revoked);
    assert_eq!(
        st.enrol_as(&beta, "beta", Some("acct")),
        EnrolOutcome::Revoked
    );
    let row = st.s.enrolment(&beta).expect("read").expect("known");
    assert_eq!(row.revoked_at_ms, Some(T0 + 2), "the first time is kept");
    assert!(row.is_revoked());
    let out = st.push_one(&alpha, T0 + 4, item("m", &[(&beta, b"x")]));
    assert_eq!(out.status.wire(), "rejected:target not enrolled");
    assert!(st
        .s
        .live_enrolments_by_name("BETA")
        .expect("by name")
        .is_empty());
    assert_eq!(st.s.live_enrolment_count().expect("count"), 1);
}

/// Spec §2 enc_ads, `wire.md` §2.8: a stored ad is served (the v2 record when there is one,
/// replacing older ads), and nothing is served for an unknown or revoked host.
pub fn enc_key_ads_are_served_until_revoked(make: &Factory) {
    let st = Store::open(make);
    let beta = key(2);
    st.enrol(&beta, "beta");
    assert_eq!(st.s.get_enc_ad(&beta).expect("read"), None, "no ad yet");
    let v1 = |enc: u8| EncAdV1 {
        host_pubkey: beta.clone(),
        host_name: "beta".to_owned(),
        enc_pub: key(enc),
        sig: format!("s{enc}"),
        at_ms: T0,
    };
    st.s.put_enc_ad_v1(v1(30)).expect("ad");
    st.s.put_enc_ad_v1(v1(31)).expect("replaced");
    let ad = st.s.get_enc_ad(&beta).expect("read").expect("served");
    assert_eq!(
        (ad.enc_pub.as_str(), ad.v1),
        (key(31).as_str(), Some(v1(31)))
    );
    let v2 = EncAdV2 {
        host_pubkey: beta.clone(),
        enc_pub: key(32),
        record: "{\"enc_pub\":\"x\"}".to_owned(),
        sig: "s2".to_owned(),
        at_ms: T0 + 1,
    };
    st.s.put_enc_ad_v2(v2.clone()).expect("record");
    let ad = st.s.get_enc_ad(&beta).expect("read").expect("served");
    assert_eq!((ad.enc_pub.as_str(), ad.v2), (key(32).as_str(), Some(v2)));
    assert_eq!(ad.host_name, "beta");
    assert_eq!(st.s.get_enc_ad(&key(9)).expect("read"), None, "unknown");
    st.s.revoke(&beta, T0 + 2).expect("revoke");
    assert_eq!(st.s.get_enc_ad(&beta).expect("read"), None, "revoked");
}

/// Spec §2 "Sender allowlist": once a target published a list, other senders are refused; a
/// list with the same or an older `iat` is stale and changes nothing; a newer one replaces it;
/// repeated senders are stored once, and the signed record comes back as stored.
pub fn a_newer_sender_list_replaces_and_refuses_other_senders(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta, mallory) = (key(1), key(2), key(6));
    st.enrol(&alpha, "alpha");
    st.enrol(&beta, "beta");
    st.enrol(&mallory, "mallory");
    let status = |sender: &str, id: &str| {
        st.push_one(sender, T0, item(id, &[(&beta, b"x")]))
            .status
            .wire()
    };
    assert_eq!(st.s.sender_list(&beta).expect("read"), None);
    assert_eq!(status(&mallory, "m0"), "accepted", "no list: anyone");
    let put = |l: SenderList| st.s.put_sender_list(l).expect("put");
    assert_eq!(
        put(list(&beta, &[&alpha, &alpha], 100)),
        SenderListOutcome::Stored
    );
    let stored = st.s.sender_list(&beta).expect("read").expect("stored");
    assert_eq!(stored.senders, vec![alpha.clone()], "duplicates dropped");
    assert_eq!(stored.record, list(&beta, &[], 100).record);
    assert_eq!(
        status(&mallory, "m1"),
        "rejected:sender not accepted by target"
    );
    assert_eq!(status(&alpha, "a1"), "accepted");
    assert_eq!(put(list(&beta, &[&mallory], 100)), SenderListOutcome::Stale);
    assert_eq!(put(list(&beta, &[&mallory], 99)), SenderListOutcome::Stale);
    assert_eq!(
        status(&mallory, "m2"),
        "rejected:sender not accepted by target"
    );
    assert_eq!(
        put(list(&beta, &[&mallory], 101)),
        SenderListOutcome::Stored
    );
    assert_eq!(status(&mallory, "m3"), "accepted");
    assert_eq!(
        status(&alpha, "a2"),
        "rejected:sender not accepted by target"
    );
}

/// Spec §3 dedup before validation: a retry of an item already stored for a target settles
/// as `duplicate` even after the target was revoked or stopped accepting the sender.
pub fn a_retry_settles_by_dedup_after_the_target_changed(make: &Factory) {
    let st = Store::open(make);
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    st.enrol(&alpha, "alpha");
    st.enrol(&beta, "beta");
    st.enrol(&gamma, "gamma");
    let b = st.push_one(&alpha, T0, item("m", &[(&beta, b"b")]));
    let g = st.push_one(&alpha, T0, item("m", &[(&gamma, b"g")]));
    st.s.revoke(&beta, T0 + 1).expect("revoke");
    st.s.put_sender_list(list(&gamma, &[], T0)).expect("list");
    let again = st.push_one(&alpha, T0 + 2, item("m", &[(&beta, b"b")]));
    assert_eq!(
        (again.status, again.targets),
        (ItemStatus::Duplicate, b.targets)
    );
    let again = st.push_one(&alpha, T0 + 2, item("m", &[(&gamma, b"g")]));
    assert_eq!(
        (again.status, again.targets),
        (ItemStatus::Duplicate, g.targets)
    );
}

/// Spec §2 "Rotation": the new key takes the name and account, the queued items (in order,
/// re-sequenced at or after now), the old key's allowlist, and its place in other targets'
/// allowlists; the old key is revoked and serves no enc key; a retry naming the old key is a
/// duplicate; the same rotation again is `AlreadyRotated`.
pub fn rotation_moves_name_account_queue_and_allowlists_and_revokes_the_old_key(make: &Factory) {
    let st = Store::open(make);
    let (old, new, a, b) = (key(1), key(2), key(3), key(4));
    st.enrol_as(&old, "laptop", Some("acct-1"));
    st.enrol(&a, "alpha");
    st.enrol(&b, "beta");
    st.s.put_enc_ad_v1(EncAdV1 {
        host_pubkey: old.clone(),
        host_name: "laptop".to_owned(),
        enc_pub: key(9),
        sig: "s1".to_owned(),
        at_ms: T0,
    })
    .expect("ad");
    st.s.put_sender_list(list(&old, &[&a], T0)).expect("list");
    st.s.put_sender_list(list(&b, &[&a, &old], T0))
        .expect("list");
    let i1 = st.push_one(&a, T0, item("i1", &[(&old, b"w1")]));
    st.push_one(&a, T0, item("i2", &[(&old, b"w2")]));
    let at = T0 + 5_000;
    let out =
        st.s.rotate(rotation(&old, &new, "LAPTOP", at))
            .expect("rotate");
    assert_eq!(out, RotateOutcome::Rotated { moved: 2 });
    let e = st.s.enrolment(&new).expect("read").expect("enrolled");
    assert_eq!(
        (
            e.host_name.as_str(),
            e.account.as_deref(),
            e.strength,
            e.revoked_at_ms
        ),
        ("laptop", Some("acct-1"), AuthorityStrength::Account, None)
    );
    let gone = st.s.enrolment(&old).expect("read").expect("kept");
    assert_eq!(gone.revoked_at_ms, Some(at));
    assert_eq!(st.s.get_enc_ad(&old).expect("read"), None);
    assert_eq!(st.queued_ids(&new), ["i1", "i2"]);
    assert_eq!(st.queued_seqs(&new), [at, at + 1]);
    assert!(st.pull_all(&old).items.is_empty());
    let own = st.s.sender_list(&new).expect("read").expect("moved");
    assert_eq!(own.senders, vec![a.clone()]);
    assert_eq!(own.record, list(&old, &[], T0).record, "as signed");
    assert_eq!(st.s.sender_list(&old).expect("read"), None);
    let bl = st.s.sender_list(&b).expect("read").expect("kept");
    assert_eq!(bl.senders, vec![a.clone(), new.clone()]);
    let retry = st.push_one(&a, at + 1, item("i1", &[(&old, b"w1")]));
    assert_eq!(
        (retry.status, retry.targets),
        (ItemStatus::Duplicate, i1.targets)
    );
    assert_eq!(
        st.s.rotate(rotation(&old, &new, "laptop", at + 1))
            .expect("again"),
        RotateOutcome::AlreadyRotated
    );
    assert_eq!(
        st.s.rotate(rotation(&old, &key(7), "laptop", at + 1))
            .expect("other"),
        RotateOutcome::NotEnrolled
    );
    assert_eq!(st.queued_seqs(&new), [at, at + 1], "nothing moved twice");
}

/// Spec §2 "Rotation": when the new key already has queued items, the old queue is appended
/// after them; an item the sender already pushed to the new key is not moved twice; the new
/// key's own allowlist and stronger account are kept.
pub fn rotation_appends_the_old_queue_after_the_new_keys_own(make: &Factory) {
    let st = Store::open(make);
    let (old, new, a, b) = (key(1), key(2), key(3), key(4));
    st.enrol(&old, "laptop");
    st.enrol_as(&new, "laptop-new", Some("acct-9"));
    st.enrol(&a, "alpha");
    st.enrol(&b, "beta");
    st.s.put_sender_list(list(&old, &[&a], T0)).expect("list");
    st.s.put_sender_list(list(&new, &[&b, &a], T0 + 1))
        .expect("list");
    st.push_one(&b, T0 + 3_000, item("own", &[(&new, b"own")]));
    st.push_one(&a, T0 + 2_000, item("moved", &[(&old, b"m")]));
    st.push_one(&a, T0 + 2_000, item("dup", &[(&old, b"d-old")]));
    st.push_one(&a, T0 + 3_000, item("dup", &[(&new, b"d-new")]));
    let out =
        st.s.rotate(rotation(&old, &new, "laptop", T0 + 4_000))
            .expect("rotate");
    assert_eq!(out, RotateOutcome::Rotated { moved: 1 });
    assert_eq!(st.queued_ids(&new), ["own", "dup", "moved"]);
    let e = st.s.enrolment(&new).expect("read").expect("enrolled");
    assert_eq!(
        (e.host_name.as_str(), e.account.as_deref()),
        ("laptop", Some("acct-9"))
    );
    let own = st.s.sender_list(&new).expect("read").expect("kept");
    assert_eq!(own.senders, vec![b.clone(), a.clone()]);
}

/// `wire.md` §3.1 rotate errors: an unknown old key, another host's name, a revoked new key
/// or a name taken in the new key's account are refused, and nothing changes.
pub fn rotation_refusals_change_nothing(make: &Factory) {
    let st = Store::open(make);
    let (old, new, other, a) = (key(1), key(2), key(3), key(4));
    st.enrol(&old, "laptop");
    st.enrol(&a, "alpha");
    st.push_one(&a, T0, item("i1", &[(&old, b"w1")]));
    let before = st.pull_all(&old);
    let rotate = |o: &str, host: &str| {
        st.s.rotate(rotation(o, &new, host, T0 + 1))
            .expect("rotate")
    };
    assert_eq!(rotate(&key(8), "laptop"), RotateOutcome::NotEnrolled);
    assert_eq!(rotate(&old, "desktop"), RotateOutcome::OtherHost);
    st.enrol_as(&new, "n", Some("acct-2"));
    st.enrol_as(&other, "LAPTOP", Some("acct-2"));
    assert_eq!(rotate(&old, "laptop"), RotateOutcome::TargetNameTaken);
    st.s.revoke(&new, T0).expect("revoke");
    assert_eq!(rotate(&old, "laptop"), RotateOutcome::TargetRevoked);
    assert_eq!(st.pull_all(&old), before);
    let row = st.s.enrolment(&old).expect("read").expect("kept");
    assert_eq!(
        (row.host_name.as_str(), row.revoked_at_ms),
        ("laptop", None)
    );
}

/// Spec §8 "Revocation": a deny entry denies its host fingerprint (or client id) until its
/// end (exclusive), a host entry is reported before a client entry, a write replaces the
/// entry of the same kind and value, and an entry can be removed once.
pub fn deny_entries_match_until_they_end_and_can_be_removed(make: &Factory) {
    let st = Store::open(make);
    let fp = fingerprint(&key(1));
    let other = fingerprint(&key(2));
    let entry = |kind, value: &str, until_ms, at_ms| DenyEntry {
        kind,
        value: value.to_owned(),
        until_ms,
        at_ms,
    };
    assert_eq!(st.s.denied(&fp, Some("cli"), 100).expect("read"), None);
    let host = entry(DenyKind::Host, &fp, None, 100);
    assert_eq!(
        st.s.deny(host.clone()).expect("deny"),
        DenyOutcome::Stored(host.clone())
    );
    st.s.deny(entry(DenyKind::Client, "cli", Some(200), 100))
        .expect("deny");
    assert_eq!(
        st.s.denied(&fp, Some("cli"), 150).expect("read"),
        Some(host)
    );
    let kind = |fp: &str, client, now| st.s.denied(fp, client, now).expect("read").map(|e| e.kind);
    assert_eq!(kind(&other, Some("cli"), 199), Some(DenyKind::Client));
    assert_eq!(kind(&other, None, 150), None, "only for its client id");
    assert_eq!(kind(&other, Some("cli"), 200), None, "until is exclusive");
    st.s.deny(entry(DenyKind::Client, "cli", Some(900), 150))
        .expect("extend");
    let entries = st.s.deny_entries().expect("list");
    assert_eq!(entries.len(), 2, "{entries:?}");
    assert_eq!(
        (entries[0].kind, entries[0].until_ms),
        (DenyKind::Client, Some(900)),
        "ordered by kind then value, replaced in place"
    );
    assert_eq!(kind(&other, Some("cli"), 899), Some(DenyKind::Client));
    assert!(st.s.undeny(DenyKind::Client, "cli").expect("undeny"));
    assert!(!st.s.undeny(DenyKind::Client, "cli").expect("undeny"));
    assert_eq!(kind(&other, Some("cli"), 300), None);
}

/// Spec §2 "Rotation" with §8: the old key's active host deny entry is carried to the new
/// key's fingerprint; the old entry stays as written.
pub fn rotation_carries_the_old_keys_deny_entries(make: &Factory) {
    let st = Store::open(make);
    let (old, new) = (key(1), key(2));
    st.enrol(&old, "laptop");
    st.s.deny(DenyEntry {
        kind: DenyKind::Host,
        value: fingerprint(&old),
        until_ms: None,
        at_ms: T0,
    })
    .expect("deny");
    let out =
        st.s.rotate(rotation(&old, &new, "laptop", T0 + 1))
            .expect("rotate");
    assert_eq!(out, RotateOutcome::Rotated { moved: 0 });
    assert!(st
        .s
        .denied(&fingerprint(&new), None, T0 + 10_000)
        .expect("read")
        .is_some());
    assert!(st
        .s
        .denied(&fingerprint(&old), None, T0 + 10_000)
        .expect("read")
        .is_some());
}

/// Spec §8: an account binding is written in its enrolment's transaction and only when it
/// enrols; a cloud key serves one live host key at a time.
pub fn an_account_binding_is_written_with_its_enrolment_and_a_cloud_key_serves_one_host(
    make: &Factory,
) {
    let st = Store::open(make);
    let (a, b, c) = (key(1), key(2), key(3));
    let binding = |k: &str, jkt: &str| AccountBinding {
        host_pubkey: k.to_owned(),
        cloud_jkt: jkt.to_owned(),
        client_id: "client".to_owned(),
        sub: format!("sub-{jkt}"),
        org: None,
        at_ms: T0,
    };
    let enrol = |k: &str, name: &str, jkt: &str| {
        st.s.enrol_bound(enrol_request(k, name, Some("acct")), Some(binding(k, jkt)))
            .expect("enrol")
    };
    assert!(matches!(enrol(&a, "mac", "j1"), EnrolOutcome::Enrolled(_)));
    assert_eq!(
        st.s.account_binding(&a).expect("read"),
        Some(binding(&a, "j1"))
    );
    assert_eq!(enrol(&b, "MAC", "j2"), EnrolOutcome::NameTaken);
    assert_eq!(
        st.s.account_binding(&b).expect("read"),
        None,
        "refused: no binding"
    );
    assert_eq!(enrol(&b, "two", "j1"), EnrolOutcome::CloudKeyTaken);
    assert_eq!(st.s.enrolment(&b).expect("read"), None, "nothing written");
    assert!(matches!(enrol(&a, "mac", "j3"), EnrolOutcome::Enrolled(_)));
    assert_eq!(
        st.s.account_binding(&a).expect("read").map(|x| x.cloud_jkt),
        Some("j3".to_owned()),
        "replaced"
    );
    st.s.revoke(&a, T0 + 1).expect("revoke");
    assert_eq!(enrol(&a, "mac", "j4"), EnrolOutcome::Revoked);
    assert!(
        matches!(enrol(&c, "three", "j3"), EnrolOutcome::Enrolled(_)),
        "freed"
    );
}
