//! The states a relay accept leads to (`wire.md` §3.5 "Epoch change / rewind", "Settle").

use super::*;
use crate::testutil::{self, Store, T0};

const R: &str = "http://127.0.0.1:9";
const DEADLINE: i64 = T0 + 15 * 86_400_000;

/// `n` messages alice@home → bob@work, each accepted by relay `R` in epoch `e1` at seq 10+i
/// with the accept time T0 and the deadline [`DEADLINE`] (wire bytes `w<i>`).
fn accepted(n: usize) -> (Store, Vec<String>) {
    let s = testutil::store();
    let me = testutil::identity("home");
    s.add_peer(&testutil::identity("work"), false);
    let mut gen = testutil::ids();
    let ids: Vec<String> = (0..n).map(|_| gen.next(T0)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
        s.mailbox
            .with(|c| {
                set_wire(c, id, "work", format!("w{i}").as_bytes(), "h")?;
                accept(c, id, "e1", 10 + i as i64, T0, DEADLINE);
                Ok(())
            })
            .unwrap();
    }
    (s, ids)
}

fn accept(c: &Connection, id: &str, epoch: &str, seq: i64, at: i64, deadline: i64) -> bool {
    let a = Accepted {
        relay: R,
        epoch,
        seq,
        accept: "{}",
        sig: "s",
        accepted_at: at,
        deadline_at: deadline,
    };
    settle_accepted(c, id, "work", &a, at).unwrap()
}

fn state(s: &Store, id: &str) -> Row {
    s.mailbox.with(|c| get(c, id, "work")).unwrap().unwrap()
}

#[test]
fn a_new_epoch_makes_accepted_rows_repush_keeping_bytes_accept_time_and_deadline() {
    let (s, ids) = accepted(4);
    let (a, b, other, confirmed) = (&ids[0], &ids[1], &ids[2], &ids[3]);
    s.mailbox
            .with(|c| {
                // b was accepted again in e2 already; `other` by another relay; `confirmed`
                // has its host's delivery receipt.
                c.execute("UPDATE outbox SET epoch = 'e2' WHERE msg_id = ?1", [b])?;
                c.execute(
                    "UPDATE outbox SET relay = 'http://other' WHERE msg_id = ?1",
                    [other],
                )?;
                c.execute(
                    "INSERT INTO remote_receipts VALUES (?1,'bob@work','work','delivered','t',NULL,NULL,1,'{}','s',1)",
                    [confirmed],
                )?;
                c.execute("UPDATE outbox SET attempts = 3", [])?;
                assert_eq!(repush_for_epoch(c, R, "e2", Repush::Epoch, T0 + 100)?, 1);
                Ok(())
            })
            .unwrap();
    let r = state(&s, a);
    assert_eq!(
        (
            r.state.as_str(),
            r.next_at,
            r.attempts,
            r.last_error.as_deref()
        ),
        ("repush", T0 + 100, 2, Some("relay epoch: re-push"))
    );
    assert_eq!((r.accepted_at, r.deadline_at), (Some(T0), Some(DEADLINE)));
    assert_eq!(
        (r.wire.as_deref(), r.epoch.as_deref()),
        (Some(&b"w0"[..]), Some("e1"))
    );
    for id in [b, other, confirmed] {
        assert_eq!(state(&s, id).state, "relay-accepted", "{id}");
    }
    // A rewind in e2 takes every row this relay accepted, and the re-push again.
    s.mailbox
        .with(|c| {
            assert_eq!(repush_for_epoch(c, R, "e2", Repush::Rewind, T0 + 200)?, 2);
            Ok(())
        })
        .unwrap();
    for id in [a, b] {
        let r = state(&s, id);
        assert_eq!(
            (r.state.as_str(), r.next_at, r.last_error.as_deref()),
            ("repush", T0 + 200, Some("relay rewind: re-push")),
            "{id}"
        );
    }
    assert_eq!(state(&s, b).deadline_at, Some(DEADLINE));
    assert_eq!(state(&s, confirmed).state, "relay-accepted");
}

#[test]
fn a_repush_is_sent_by_either_transport_and_an_accept_keeps_its_first_time_and_deadline() {
    let (s, ids) = accepted(1);
    let id = &ids[0];
    s.mailbox
        .with(|c| {
            assert!(
                due_for_relay(c, i64::MAX, 10)?.is_empty(),
                "held by the relay"
            );
            repush_for_epoch(c, R, "e2", Repush::Epoch, T0 + 100)?;
            assert_eq!(due_for_relay(c, T0 + 100, 10)?.len(), 1);
            assert_eq!(next_due_for_relay(c, T0 + 100)?, Some(T0 + 100));
            assert_eq!(next_due_at(c, T0 + 100)?, Some(T0 + 100));
            // With a LAN address and fewer than two LAN failures the LAN takes it.
            c.execute("UPDATE peers SET addr = '127.0.0.1:1'", [])?;
            c.execute("UPDATE outbox SET lan_failures = 0", [])?;
            assert_eq!(due_for_lan(c, T0 + 100, 10, true)?.len(), 1);
            assert!(due_for_relay(c, T0 + 100, 10)?.is_empty());
            // A fresh accept in e2 (a restored store without the item) settles it again;
            // the first accept time and deadline stay.
            assert!(accept(c, id, "e2", 7, T0 + 500, T0 + 999));
            Ok(())
        })
        .unwrap();
    let r = state(&s, id);
    assert_eq!(
        (r.state.as_str(), r.epoch.as_deref(), r.seq, r.last_error),
        ("relay-accepted", Some("e2"), Some(7), None)
    );
    assert_eq!((r.accepted_at, r.deadline_at), (Some(T0), Some(DEADLINE)));
    // An accept for a row that is not sendable changes nothing.
    s.mailbox
        .with(|c| {
            assert!(!accept(c, id, "e3", 8, T0 + 600, T0 + 999));
            Ok(())
        })
        .unwrap();
}

#[test]
fn a_lan_verdict_or_a_receipt_settles_a_repush() {
    let (s, ids) = accepted(3);
    s.mailbox
        .with(|c| {
            repush_for_epoch(c, R, "e2", Repush::Epoch, T0)?;
            assert!(delivered_lan(c, &ids[0], "work", T0 + 1)?);
            assert!(rejected_lan(c, &ids[1], "work", "refused", T0 + 1)?);
            assert!(settle_by_receipt(c, &ids[2], "work", T0 + 1)?);
            Ok(())
        })
        .unwrap();
    let got: Vec<(String, Option<String>)> = ids
        .iter()
        .map(|id| {
            let r = state(&s, id);
            (r.state, r.via)
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("delivered".into(), Some("lan".into())),
            ("rejected".into(), Some("lan".into())),
            ("delivered".into(), Some("relay".into())),
        ]
    );
}

#[test]
fn a_row_past_its_deadline_is_unconfirmed_and_a_later_receipt_still_settles_it() {
    let (s, ids) = accepted(3);
    let (a, b, c3) = (&ids[0], &ids[1], &ids[2]);
    s.mailbox
        .with(|c| {
            repush_for_epoch(c, R, "e2", Repush::Epoch, T0)?;
            accept(c, a, "e2", 50, T0, DEADLINE);
            // c3 is delivered: never overdue.
            assert!(settle_by_receipt(c, c3, "work", T0)?);
            assert!(overdue(c, DEADLINE - 1, 10)?.is_empty());
            assert!(
                !unconfirm(c, a, "work", "x", DEADLINE - 1)?,
                "not before the deadline"
            );
            let due: Vec<String> = overdue(c, DEADLINE, 10)?
                .into_iter()
                .map(|r| r.msg_id)
                .collect();
            assert_eq!(due, vec![a.clone(), b.clone()]);
            assert_eq!(overdue(c, DEADLINE, 1)?.len(), 1, "bounded");
            assert!(unconfirm(c, a, "work", "why a", DEADLINE)?);
            assert!(unconfirm(c, b, "work", "why b", DEADLINE + 1)?);
            assert!(!unconfirm(c, b, "work", "again", DEADLINE + 2)?, "once");
            assert!(!unconfirm(c, c3, "work", "x", DEADLINE)?, "delivered stays");
            assert!(overdue(c, i64::MAX, 10)?.is_empty());
            Ok(())
        })
        .unwrap();
    let r = state(&s, a);
    assert_eq!(
        (r.state.as_str(), r.last_error.as_deref()),
        ("unconfirmed", Some("why a"))
    );
    assert_eq!(state(&s, c3).state, "delivered");
    s.mailbox
        .with(|c| {
            assert!(settle_by_receipt(c, a, "work", DEADLINE + 9)?);
            Ok(())
        })
        .unwrap();
    let r = state(&s, a);
    assert_eq!(
        (r.state.as_str(), r.via.as_deref(), r.last_error),
        ("delivered", Some("relay"), None)
    );
}

#[test]
fn an_expiry_ends_a_live_row_only_and_counts_show_every_state() {
    let (s, ids) = accepted(4);
    s.mailbox
        .with(|c| {
            repush_for_epoch(c, R, "e2", Repush::Epoch, T0)?;
            accept(c, &ids[1], "e2", 60, T0, DEADLINE);
            assert!(settle_by_receipt(c, &ids[3], "work", T0)?);
            assert!(expire(c, &ids[0], "work", R, "gone", T0 + 1)?);
            assert!(!expire(c, &ids[0], "work", R, "again", T0 + 2)?, "a repeat");
            assert!(
                !expire(c, &ids[3], "work", R, "late", T0 + 2)?,
                "delivered stays"
            );
            assert!(unconfirm(c, &ids[1], "work", "late", DEADLINE)?);
            Ok(())
        })
        .unwrap();
    let r = state(&s, &ids[0]);
    assert_eq!(
        (r.state.as_str(), r.last_error.as_deref()),
        ("expired", Some("gone"))
    );
    assert_eq!(state(&s, &ids[3]).state, "delivered");
    let counts = s
        .mailbox
        .with(|c| relay_counts(c, &format!("{R}/")))
        .unwrap();
    assert_eq!(
        counts,
        RelayCounts {
            queued: 0,
            relay_accepted: 0,
            repush: 1,
            unconfirmed: 1,
            expired: 1,
        }
    );
    s.mailbox
        .with(|c| {
            assert!(settle_by_receipt(c, &ids[0], "work", T0 + 3)?);
            Ok(())
        })
        .unwrap();
    assert_eq!(
        state(&s, &ids[0]).state,
        "delivered",
        "a receipt proves delivery"
    );
}

#[test]
fn an_expiry_needs_the_relay_that_accepted_the_row_and_a_live_row() {
    let (s, ids) = accepted(3);
    let me = testutil::identity("home");
    let pending = testutil::ids().next(T0 + 10);
    s.send(&me, "alice", &["bob@work"], "hi", &pending, T0)
        .unwrap();
    s.mailbox
        .with(|c| {
            repush_for_epoch(c, R, "e2", Repush::Epoch, T0)?;
            accept(c, &ids[1], "e2", 60, T0, DEADLINE);
            assert!(unconfirm(c, &ids[2], "work", "late", DEADLINE)?);
            // Another relay's word, a row no relay accepted, a final row: no change.
            for (id, relay) in [
                (&ids[0], "http://127.0.0.1:10"),
                (&ids[1], "http://other"),
                (&pending, R),
                (&ids[2], R),
            ] {
                assert!(!expire(c, id, "work", relay, "x", T0 + 1)?, "{id} {relay}");
            }
            // The relay that accepted it (a trailing `/` is the same URL): repush and
            // relay-accepted rows both end.
            assert!(expire(c, &ids[0], "work", R, "gone", T0 + 2)?);
            assert!(expire(
                c,
                &ids[1],
                "work",
                &format!("{R}/"),
                "gone",
                T0 + 2
            )?);
            Ok(())
        })
        .unwrap();
    let got: Vec<String> = [&ids[0], &ids[1], &ids[2], &pending]
        .iter()
        .map(|id| state(&s, id).state)
        .collect();
    assert_eq!(got, ["expired", "expired", "unconfirmed", "pending"]);
}

#[test]
fn the_peers_own_word_settles_a_row_an_alert_already_ended() {
    let (s, ids) = accepted(4);
    let me = testutil::identity("home");
    // A push whose answer was lost (the relay committed): still pending, then 72 h old.
    let lost = testutil::ids().next(T0 + 10);
    s.send(&me, "alice", &["bob@work"], "hi", &lost, T0)
        .unwrap();
    let late = T0 + GIVE_UP_MS + 1;
    s.mailbox
        .with(|c| {
            repush_for_epoch(c, R, "e2", Repush::Epoch, T0)?;
            assert!(expire(c, &ids[0], "work", R, "gone", T0 + 1)?);
            assert!(unconfirm(c, &ids[1], "work", "late", DEADLINE)?);
            assert!(expire(c, &ids[2], "work", R, "gone", T0 + 1)?);
            assert!(rejected_lan(c, &ids[3], "work", "refused", T0 + 1)?);
            assert_eq!(give_up_stale(c, late, 10)?.len(), 1);
            assert_eq!(get(c, &lost, "work")?.unwrap().state, "undelivered");
            // A LAN delivery of a re-push that raced the expiry notice, one that raced the
            // deadline, and a receipt for the expired one and for the lost push.
            assert!(delivered_lan(c, &ids[0], "work", late)?);
            assert!(delivered_lan(c, &ids[1], "work", late)?);
            assert!(settle_by_receipt(c, &ids[2], "work", late)?);
            assert!(settle_by_receipt(c, &lost, "work", late)?);
            // A refusal by the peer stays a refusal.
            assert!(!delivered_lan(c, &ids[3], "work", late)?);
            assert!(!settle_by_receipt(c, &ids[3], "work", late)?);
            // Delivered is delivered: nothing changes again.
            assert!(!delivered_lan(c, &ids[0], "work", late + 1)?);
            assert!(!settle_by_receipt(c, &lost, "work", late + 1)?);
            Ok(())
        })
        .unwrap();
    let got: Vec<(String, Option<String>, Option<String>)> =
        [&ids[0], &ids[1], &ids[2], &lost, &ids[3]]
            .iter()
            .map(|id| {
                let r = state(&s, id);
                (r.state, r.via, r.last_error)
            })
            .collect();
    assert_eq!(
        got,
        vec![
            ("delivered".into(), Some("lan".into()), None),
            ("delivered".into(), Some("lan".into()), None),
            ("delivered".into(), Some("relay".into()), None),
            ("delivered".into(), Some("receipt".into()), None),
            (
                "rejected".into(),
                Some("lan".into()),
                Some("refused".into())
            ),
        ]
    );
}

#[test]
fn every_final_state_drops_the_wire_bytes_and_keeps_their_hash() {
    let (s, ids) = accepted(6);
    let me = testutil::identity("home");
    let mut gen = testutil::ids();
    let pend: Vec<String> = (0..5).map(|_| gen.next(T0 + 10)).collect();
    for id in &pend {
        s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
        s.mailbox
            .with(|c| set_wire(c, id, "work", b"p", "hp").map(|_| ()))
            .unwrap();
    }
    let late = T0 + GIVE_UP_MS + 1;
    s.mailbox
        .with(|c| {
            repush_for_epoch(c, R, "e2", Repush::Epoch, T0)?;
            accept(c, &ids[5], "e2", 70, T0, DEADLINE);
            assert!(delivered_lan(c, &ids[0], "work", T0)?);
            assert!(rejected_lan(c, &ids[1], "work", "no", T0)?);
            assert!(settle_by_receipt(c, &ids[2], "work", T0)?);
            assert!(expire(c, &ids[3], "work", R, "gone", T0)?);
            assert!(unconfirm(c, &ids[4], "work", "late", DEADLINE)?);
            assert_eq!(
                fail(c, &pend[0], "work", "rejected:conflict", true, T0)?,
                Failure::Rejected
            );
            assert_eq!(
                fail(c, &pend[1], "work", "x", false, late)?,
                Failure::GaveUp
            );
            assert_eq!(fail_lan(c, &pend[2], "work", "x", late)?, Failure::GaveUp);
            assert_eq!(give_up_stale(c, late, 1)?.len(), 1);
            Ok(())
        })
        .unwrap();
    let finals: Vec<&String> = ids[..5].iter().chain(&pend[..4]).collect();
    for id in &finals {
        let r = state(&s, id);
        assert!(
            [
                "delivered",
                "rejected",
                "expired",
                "unconfirmed",
                "undelivered"
            ]
            .contains(&r.state.as_str()),
            "{id}: {r:?}"
        );
        assert_eq!(r.wire, None, "{id}: {}", r.state);
        assert!(r.wire_hash.is_some(), "{id}: the hash stays");
    }
    // The live rows keep theirs: the relay-accepted one and the pending one.
    assert_eq!(state(&s, &ids[5]).wire.as_deref(), Some(&b"w5"[..]));
    assert_eq!(state(&s, &pend[4]).wire.as_deref(), Some(&b"p"[..]));
    // A sealing that raced the end of a row stores nothing on it.
    s.mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET wire = NULL WHERE msg_id = ?1",
                [&pend[4]],
            )?;
            assert!(settle_by_receipt(c, &pend[4], "work", late)?);
            assert_eq!(set_wire(c, &pend[4], "work", b"late", "hl")?, b"late");
            assert!(set_wire(c, "01KDVDNA3VG2MH8KWSQRCWJZ0Z", "work", b"x", "h").is_err());
            Ok(())
        })
        .unwrap();
    let r = state(&s, &pend[4]);
    assert_eq!((r.wire, r.wire_hash.as_deref()), (None, Some("hp")));
    // A late receipt for a final row only changes its state.
    s.mailbox
        .with(|c| {
            assert!(settle_by_receipt(c, &ids[3], "work", late)?);
            Ok(())
        })
        .unwrap();
    let r = state(&s, &ids[3]);
    assert_eq!((r.state.as_str(), r.wire), ("delivered", None));
    // The sender's view reads every state without the bytes (a row the host took, with no
    // receipt from the named agent stored, is `accepted`, not `delivered`: issue 17 (3)).
    let page = s
        .mailbox
        .with(|c| super::super::receipts::sent_page(c, "alice", "home", None, 100))
        .unwrap();
    let mut states: Vec<String> = page
        .messages
        .iter()
        .map(|m| m.recipients[0].state.clone())
        .collect();
    states.sort();
    assert_eq!(
        states,
        [
            "accepted",
            "accepted",
            "accepted",
            "accepted",
            "relay-accepted",
            "unconfirmed",
            "undelivered",
            "undelivered",
            "undelivered",
            "undelivered",
            "undelivered"
        ]
    );
}

#[test]
fn a_repush_follows_its_peers_rotation_and_is_resealed_keeping_its_deadline() {
    let (s, ids) = accepted(4);
    let me = testutil::identity("home");
    let old = state(&s, &ids[0]).target_pubkey;
    let new = testutil::identity("work");
    let new_pub = new.host_key.public().to_b64();
    let pending = testutil::ids().next(T0 + 10);
    s.send(&me, "alice", &["bob@work"], "hi", &pending, T0)
        .unwrap();
    s.mailbox
        .with(|c| {
            // ids[1] is already a re-push when the peer rotates; ids[0] still held.
            c.execute(
                "UPDATE outbox SET state = 'repush' WHERE msg_id = ?1",
                [&ids[1]],
            )?;
            crate::mailbox::peers::rotate(
                c,
                "work",
                &old,
                &new_pub,
                &new.enc_key.public().to_b64(),
                Some(T0 + 50),
                T0 + 50,
            )?
            .expect("rotated");
            // The rotation: the pending row and the re-push move; the held row stays.
            assert_eq!(retarget(c, "work", &old, &new_pub, T0 + 50)?, 2);
            Ok(())
        })
        .unwrap();
    for id in [&ids[1], &pending] {
        let r = state(&s, id);
        assert_eq!(
            (r.target_pubkey.as_str(), r.wire.as_deref(), r.wire_hash),
            (new_pub.as_str(), None, None),
            "{id}"
        );
        assert!(r.next_at <= T0 + 50, "{id}: due");
    }
    let r = state(&s, &ids[1]);
    assert_eq!(
        (r.state.as_str(), r.accepted_at, r.deadline_at),
        ("repush", Some(T0), Some(DEADLINE))
    );
    let held = state(&s, &ids[0]);
    assert_eq!(
        (
            held.state.as_str(),
            held.target_pubkey.as_str(),
            held.wire.as_deref()
        ),
        ("relay-accepted", old.as_str(), Some(&b"w0"[..]))
    );
    // A new epoch later makes the held rows re-pushes: they follow the rotation too.
    s.mailbox
        .with(|c| {
            assert_eq!(repush_for_epoch(c, R, "e2", Repush::Epoch, T0 + 100)?, 4);
            Ok(())
        })
        .unwrap();
    for id in [&ids[0], &ids[2], &ids[3]] {
        let r = state(&s, id);
        assert_eq!(
            (
                r.state.as_str(),
                r.target_pubkey.as_str(),
                r.wire.as_deref(),
                r.accepted_at,
                r.deadline_at
            ),
            ("repush", new_pub.as_str(), None, Some(T0), Some(DEADLINE)),
            "{id}"
        );
    }
    // Sealing again stores the new bytes once.
    s.mailbox
        .with(|c| {
            assert_eq!(set_wire(c, &ids[0], "work", b"new", "hn")?, b"new");
            assert_eq!(follow_rotations(c, None, T0 + 200)?, 0, "nothing left");
            Ok(())
        })
        .unwrap();
    assert_eq!(state(&s, &ids[0]).wire.as_deref(), Some(&b"new"[..]));
}

#[test]
fn a_row_aimed_at_a_key_the_peer_never_retired_is_not_moved() {
    let (s, ids) = accepted(2);
    let stranger = testutil::identity("work").host_key.public().to_b64();
    s.mailbox
        .with(|c| {
            // The peer was unpaired and paired again under the same name with another key:
            // no rotation vouches for the move, so the re-push is not sent to the new key.
            c.execute(
                "UPDATE peers SET pubkey = ?1 WHERE host = 'work'",
                [&stranger],
            )?;
            assert_eq!(repush_for_epoch(c, R, "e2", Repush::Epoch, T0)?, 2);
            assert_eq!(follow_rotations(c, None, T0)?, 0);
            assert_eq!(follow_rotations(c, Some(&ids[0]), T0)?, 0);
            Ok(())
        })
        .unwrap();
    for id in &ids {
        let r = state(&s, id);
        assert_ne!(r.target_pubkey, stranger, "{id}");
        assert!(r.wire.is_some(), "{id}");
    }
}
