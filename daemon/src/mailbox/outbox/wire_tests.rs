use super::*;
use crate::testutil::{self, T0};

#[test]
fn wire_bytes_are_written_once_and_failures_never_delete() {
    let s = testutil::store();
    let me = testutil::identity("home");
    s.add_peer(&testutil::identity("work"), false);
    let id = "01KDVDNA3VG2MH8KWSQRCWJZ0S";
    s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
    s.mailbox
        .with(|c| {
            assert_eq!(set_wire(c, id, "work", b"first", "h1")?, b"first");
            // A second sealing never replaces the first bytes.
            assert_eq!(set_wire(c, id, "work", b"second", "h2")?, b"first");
            let r = get(c, id, "work")?.unwrap();
            assert_eq!(r.wire_hash.as_deref(), Some("h1"));
            assert!(set_wire(c, id, "nohost", b"x", "h").is_err());
            // Retryable failures keep the row pending with backoff.
            fail(c, id, "work", "e1", false, T0)?;
            fail(c, id, "work", "e2", false, T0 + 10)?;
            let r = get(c, id, "work")?.unwrap();
            assert_eq!(
                (r.state.as_str(), r.attempts, r.next_at),
                ("pending", 2, T0 + 10 + backoff_ms(1))
            );
            // A terminal one keeps it, as rejected; later failures change nothing.
            fail(c, id, "work", "rejected:conflict", true, T0 + 20)?;
            fail(c, id, "work", "late", false, T0 + 30)?;
            let r = get(c, id, "work")?.unwrap();
            assert_eq!(
                (r.state.as_str(), r.attempts, r.last_error.as_deref()),
                ("rejected", 3, Some("rejected:conflict"))
            );
            assert!(due(c, i64::MAX, 10)?.is_empty());
            assert_eq!(counts(c)?, vec![("rejected".to_string(), 1)]);
            Ok(())
        })
        .unwrap();
}

#[test]
fn the_72_hour_rule_spares_rows_a_relay_accepted_and_the_sweep_ends_the_rest() {
    let s = testutil::store();
    let me = testutil::identity("home");
    s.add_peer(&testutil::identity("work"), false);
    let mut ids = testutil::ids();
    let (a, b, c3) = (ids.next(T0), ids.next(T0), ids.next(T0));
    for id in [&a, &b, &c3] {
        s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
    }
    let late = T0 + GIVE_UP_MS + 1;
    s.mailbox
        .with(|c| {
            // b: a relay accepted it, then a new epoch made it a re-push.
            c.execute(
                "UPDATE outbox SET state = 'repush', accepted_at = ?2 WHERE msg_id = ?1",
                params![b, T0],
            )?;
            assert_eq!(fail(c, &b, "work", "x", false, late)?, Failure::Retry);
            assert_eq!(fail_lan(c, &b, "work", "x", late)?, Failure::Retry);
            // Not even a refusal retrying cannot help ends a re-push: its deadline does.
            assert_eq!(
                fail(c, &b, "work", "rejected:conflict", true, late)?,
                Failure::Retry
            );
            assert_eq!(
                fail(c, &a, "work", "x", false, T0 + GIVE_UP_MS)?,
                Failure::Retry
            );
            assert_eq!(fail(c, &a, "work", "x", false, late)?, Failure::GaveUp);
            assert_eq!(fail(c, &a, "work", "x", false, late)?, Failure::Gone);
            let r = get(c, &a, "work")?.unwrap();
            assert_eq!(
                (r.state.as_str(), r.last_error.as_deref()),
                ("undelivered", Some("gave up after 72 h (x)"))
            );
            // The sweep: only c3 is left to end; b was accepted by a relay once.
            assert!(give_up_stale(c, T0 + GIVE_UP_MS, 10)?.is_empty());
            let ended = give_up_stale(c, late, 10)?;
            assert_eq!(
                ended,
                vec![GaveUp {
                    msg_id: c3.clone(),
                    host: "work".into(),
                    reason: format!("gave up after 72 h ({NO_TRANSPORT})"),
                }]
            );
            assert!(give_up_stale(c, i64::MAX, 10)?.is_empty());
            let r = get(c, &b, "work")?.unwrap();
            assert_eq!((r.state.as_str(), r.attempts), ("repush", 3));
            Ok(())
        })
        .unwrap();
}

#[test]
fn back_to_lan_needs_a_lan_address_and_a_row_no_relay_holds() {
    let s = testutil::store();
    let me = testutil::identity("home");
    s.add_peer(&testutil::identity("work"), false);
    let mut ids = testutil::ids();
    let (a, b, r) = (ids.next(T0), ids.next(T0), ids.next(T0));
    for id in [&a, &b, &r] {
        s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
    }
    s.mailbox
        .with(|c| {
            c.execute("UPDATE outbox SET lan_failures = 3", [])?;
            // No LAN address: stays with the relay.
            assert!(!back_to_lan(c, &a, "work")?);
            c.execute(
                "UPDATE peers SET addr = '127.0.0.1:1' WHERE host = 'work'",
                [],
            )?;
            assert!(back_to_lan(c, &a, "work")?);
            assert_eq!(
                get(c, &a, "work")?.unwrap().lan_failures,
                LAN_FAILURES_BEFORE_RELAY - 1
            );
            // Already below the threshold: nothing to do.
            assert!(!back_to_lan(c, &a, "work")?);
            // A row a relay holds is not sent by any transport.
            c.execute(
                "UPDATE outbox SET state = 'relay-accepted', accepted_at = ?2 WHERE msg_id = ?1",
                params![b, T0],
            )?;
            assert!(!back_to_lan(c, &b, "work")?);
            // A re-push may go over the LAN like a pending row.
            c.execute(
                "UPDATE outbox SET state = 'repush', accepted_at = ?2 WHERE msg_id = ?1",
                params![r, T0],
            )?;
            assert!(back_to_lan(c, &r, "work")?);
            Ok(())
        })
        .unwrap();
}
