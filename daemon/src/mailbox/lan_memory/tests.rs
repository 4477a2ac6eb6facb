use super::*;
use crate::mailbox::outbox;
use crate::testutil::{self, T0};

/// A peer with an address, three queued rows: `lan` on the LAN route with a LAN backoff,
/// `failing` whose attempt just failed, and `relay` already on the relay route backing off.
fn setup() -> (testutil::Store, String, String, String) {
    let s = testutil::store();
    let me = testutil::identity("home");
    let work = testutil::identity("work");
    s.add_peer(&work, true);
    s.mailbox
        .with(|c| {
            c.execute(
                "UPDATE peers SET addr = '127.0.0.1:1' WHERE host = 'work'",
                [],
            )?;
            Ok(())
        })
        .unwrap();
    let mut gen = testutil::ids();
    let mut ids = Vec::new();
    for (lan_failures, next_at) in [(1, T0 + 5_000), (1, T0 + 5_000), (2, T0 + 9_000)] {
        let id = gen.next(T0);
        s.send(&me, "alice", &["bob@work"], "s", &id, T0).unwrap();
        s.mailbox
            .with(|c| {
                c.execute(
                    "UPDATE outbox SET lan_failures = ?2, next_at = ?3, attempts = ?2
                     WHERE msg_id = ?1",
                    rusqlite::params![id, lan_failures, next_at],
                )?;
                Ok(())
            })
            .unwrap();
        ids.push(id);
    }
    let relay = ids.pop().unwrap();
    let failing = ids.pop().unwrap();
    let lan = ids.pop().unwrap();
    (s, lan, failing, relay)
}

fn next_at(s: &testutil::Store, id: &str) -> i64 {
    s.mailbox
        .with(|c| Ok(outbox::get(c, id, "work")?.unwrap().next_at))
        .unwrap()
}

/// The mark switches the rows the LAN was taking (including the one whose failure made the
/// decision) to the relay at once, leaves a row backing off on the relay route alone, and from
/// then on the relay takes every row of the peer, new ones too.
#[test]
fn the_mark_switches_lan_rows_to_the_relay_now() {
    let (s, lan, failing, relay) = setup();
    let now = T0 + 1_000;
    let (marked, route) = s
        .mailbox
        .with(|c| {
            let tx = c.transaction()?;
            let route = lan_route(&tx, "work")?;
            // The failed attempt of `failing` reaches the threshold.
            outbox::fail_lan(&tx, &failing, "work", "connection refused", now)?;
            let marked = mark_down(&tx, "work", DownReason::Refused, now, now + 5_000, &route)?;
            tx.commit()?;
            Ok((marked, route))
        })
        .unwrap();
    assert!(marked);
    assert_eq!(route.rows, vec![lan.clone(), failing.clone()]);
    assert_eq!(next_at(&s, &lan), now);
    assert_eq!(next_at(&s, &failing), now);
    assert_eq!(next_at(&s, &relay), T0 + 9_000, "a relay backoff is kept");
    let (lan_rows, relay_rows) = s
        .mailbox
        .with(|c| {
            Ok((
                outbox::due_for_lan(c, now, 100, true)?,
                outbox::due_for_relay(c, now, 100)?,
            ))
        })
        .unwrap();
    assert!(lan_rows.is_empty());
    let ids: Vec<String> = relay_rows.into_iter().map(|r| r.msg_id).collect();
    assert_eq!(ids, vec![lan.clone(), failing.clone()]);
    // Without a relay the LAN keeps trying the marked address.
    let lan_rows = s
        .mailbox
        .with(|c| outbox::due_for_lan(c, now, 100, false))
        .unwrap();
    assert_eq!(lan_rows.len(), 2);
    // A second mark changes nothing.
    let again = s
        .mailbox
        .with(|c| {
            let route = lan_route(c, "work")?;
            mark_down(c, "work", DownReason::Timeout, now + 9, now + 9, &route)
        })
        .unwrap();
    assert!(!again);
    let st = s.mailbox.with(|c| get(c, "work")).unwrap().unwrap();
    assert_eq!(st.down_since, Some(now));
    assert_eq!(st.down_reason.as_deref(), Some("refused"));
}

/// An inbound hop brings the probe forward but does not clear the mark; a probe that fails
/// backs off; a probe that answers clears it and the LAN takes the rows again.
#[test]
fn only_an_answering_address_clears_the_mark() {
    let (s, lan, _failing, _relay) = setup();
    let now = T0 + 1_000;
    s.mailbox
        .with(|c| {
            let route = lan_route(c, "work")?;
            mark_down(c, "work", DownReason::Timeout, now, now + 60_000, &route)?;
            Ok(())
        })
        .unwrap();
    assert!(s.mailbox.with(|c| due_probes(c, now)).unwrap().is_empty());
    // The hop path: the probe comes forward (5 s from now at the soonest).
    assert_eq!(
        s.mailbox.with(|c| alive(c, "work", now + 1)).unwrap(),
        Some(true)
    );
    assert!(s
        .mailbox
        .with(|c| due_probes(c, now + 1))
        .unwrap()
        .is_empty());
    assert_eq!(
        s.mailbox
            .with(|c| due_probes(c, now + 1 + PROBE_FIRST_MS))
            .unwrap(),
        vec![("work".to_string(), "127.0.0.1:1".to_string())]
    );
    assert!(
        s.mailbox
            .with(|c| outbox::due_for_lan(c, now + 1, 100, true))
            .unwrap()
            .is_empty(),
        "still on the relay"
    );
    let fails = s
        .mailbox
        .with(|c| probe_failed(c, "work", now, 0.5))
        .unwrap();
    assert_eq!(fails, Some(1));
    assert_eq!(
        s.mailbox.with(|c| next_probe_at(c)).unwrap(),
        Some(now + 10_000)
    );
    assert!(s.mailbox.with(|c| clear(c, "work", now + 2)).unwrap());
    let lan_rows = s
        .mailbox
        .with(|c| outbox::due_for_lan(c, now + 2, 100, true))
        .unwrap();
    assert!(lan_rows.iter().any(|r| r.msg_id == lan));
    assert!(!s.mailbox.with(|c| clear(c, "work", now + 3)).unwrap());
    assert_eq!(s.mailbox.with(|c| next_probe_at(c)).unwrap(), None);
}

#[test]
fn probe_backoff_doubles_to_five_minutes_with_jitter() {
    assert_eq!(probe_delay_ms(0, 0.5), 5_000);
    assert_eq!(probe_delay_ms(1, 0.5), 10_000);
    assert_eq!(probe_delay_ms(6, 0.5), 300_000);
    assert_eq!(probe_delay_ms(40, 0.5), 300_000);
    assert_eq!(probe_delay_ms(0, 0.0), 3_750);
    assert_eq!(probe_delay_ms(0, 1.0), 6_250);
}

#[test]
fn the_route_in_words() {
    let (s, _lan, _failing, _relay) = setup();
    let now = T0 + 1_000;
    let route = |relay| {
        s.mailbox
            .with(|c| route_text(c, "work", now + 2_000, relay))
            .unwrap()
    };
    assert_eq!(route(true).as_deref(), Some("lan"));
    s.mailbox
        .with(|c| {
            let r = lan_route(c, "work")?;
            mark_down(c, "work", DownReason::Refused, now, now + 5_000, &r)?;
            Ok(())
        })
        .unwrap();
    let text = route(true).unwrap();
    assert!(
        text.starts_with("relay (LAN unreachable since ")
            && text.ends_with("(refused), next LAN probe in 3 s)"),
        "{text}"
    );
    assert!(route(false).unwrap().starts_with("lan (unreachable since "));
    assert_eq!(
        s.mailbox
            .with(|c| route_text(c, "nobody", now, true))
            .unwrap(),
        None
    );
}

/// Receipts follow the rule of mail: the mark switches the receipts the LAN was taking to the
/// relay, due now, and leaves one backing off on the relay route alone.
#[test]
fn the_mark_switches_receipts_too() {
    let (s, _lan, _failing, _relay) = setup();
    let now = T0 + 1_000;
    s.mailbox
        .with(|c| {
            c.execute(
                "INSERT INTO receipt_outbox(msg_id, agent, host, state, at, attempts, lan_failures, next_at, created_at)
                 VALUES ('r1', 'bob', 'work', 'delivered', 1, 1, 1, ?1, 1),
                        ('r2', 'bob', 'work', 'delivered', 1, 2, 2, ?2, 1)",
                rusqlite::params![T0 + 5_000, T0 + 9_000],
            )?;
            let route = lan_route(c, "work")?;
            assert_eq!(route.receipts.len(), 1);
            assert!(mark_down(c, "work", DownReason::Unreachable, now, now + 5_000, &route)?);
            Ok(())
        })
        .unwrap();
    let times: Vec<(String, i64)> = s
        .mailbox
        .with(|c| {
            let mut st = c.prepare("SELECT msg_id, next_at FROM receipt_outbox ORDER BY msg_id")?;
            let rows = st
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .unwrap();
    assert_eq!(
        times,
        vec![("r1".to_string(), now), ("r2".to_string(), T0 + 9_000)]
    );
    let (lan, relay) = s
        .mailbox
        .with(|c| {
            Ok((
                crate::mailbox::receipts::due_for_lan(c, now, 10, true)?.len(),
                crate::mailbox::receipts::due_for_relay(c, now, 10)?.len(),
            ))
        })
        .unwrap();
    assert_eq!((lan, relay), (0, 1));
}

fn peer_state(s: &testutil::Store) -> LanState {
    s.mailbox.with(|c| get(c, "work")).unwrap().unwrap()
}

/// A lifted mark counts until a real LAN delivery proves the address: a peer marked again soon
/// after each lift waits twice as long each time for its next probe; a delivery, or ten
/// minutes unmarked, starts the count again.
#[test]
fn a_lifted_mark_counts_until_a_lan_delivery_and_marks_back_off() {
    let (s, _lan, _failing, _relay) = setup();
    let mut now = T0 + 1_000;
    for (fails, wait) in [(0, 5_000), (1, 10_000), (2, 20_000)] {
        s.mailbox
            .with(|c| {
                let route = lan_route(c, "work")?;
                assert!(mark_down(
                    c,
                    "work",
                    DownReason::Failed,
                    now,
                    now + 5_000,
                    &route
                )?);
                Ok(())
            })
            .unwrap();
        let st = peer_state(&s);
        assert_eq!((st.probe_fails, st.probe_at), (fails, Some(now + wait)));
        now += wait;
        assert!(s.mailbox.with(|c| clear(c, "work", now)).unwrap());
        now += 1;
    }
    assert_eq!(peer_state(&s).probe_fails, 3);
    // A delivery over the LAN resets the count; the next mark waits 5 s again.
    s.mailbox.with(|c| lan_delivered(c, "work")).unwrap();
    assert_eq!(peer_state(&s).probe_fails, 0);
    // Ten minutes unmarked does too.
    s.mailbox
        .with(|c| {
            let route = lan_route(c, "work")?;
            mark_down(c, "work", DownReason::Refused, now, now + 5_000, &route)?;
            clear(c, "work", now + 1)?;
            assert_eq!(get(c, "work")?.unwrap().probe_fails, 1);
            let later = now + 1 + STABLE_MS;
            mark_down(c, "work", DownReason::Refused, later, later + 5_000, &route)?;
            let st = get(c, "work")?.unwrap();
            assert_eq!((st.probe_fails, st.probe_at), (0, Some(later + 5_000)));
            Ok(())
        })
        .unwrap();
    // The wait never passes five minutes (jitter kept).
    s.mailbox
        .with(|c| {
            c.execute(
                "UPDATE peers SET lan_down_since = NULL, lan_probe_fails = 30, lan_probe_at = ?1",
                [now],
            )?;
            let route = lan_route(c, "work")?;
            mark_down(c, "work", DownReason::Refused, now, now + 6_000, &route)?;
            assert_eq!(get(c, "work")?.unwrap().probe_at, Some(now + 360_000));
            Ok(())
        })
        .unwrap();
}

/// A failed probe of a peer that is not marked (any more) changes nothing: one guarded
/// statement.
#[test]
fn a_failed_probe_of_an_unmarked_peer_changes_nothing() {
    let (s, _lan, _failing, _relay) = setup();
    let now = T0 + 1_000;
    assert_eq!(
        s.mailbox
            .with(|c| probe_failed(c, "work", now, 0.5))
            .unwrap(),
        None
    );
    let st = peer_state(&s);
    assert_eq!((st.probe_fails, st.probe_at), (0, None));
    s.mailbox
        .with(|c| {
            let route = lan_route(c, "work")?;
            mark_down(c, "work", DownReason::Timeout, now, now + 5_000, &route)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(
        s.mailbox
            .with(|c| probe_failed(c, "work", now, 0.0))
            .unwrap(),
        Some(1)
    );
    assert_eq!(
        s.mailbox
            .with(|c| probe_failed(c, "work", now, 1.0))
            .unwrap(),
        Some(2)
    );
    assert_eq!(peer_state(&s).probe_at, Some(now + 25_000));
}

fn verdict(down: Option<DownReason>, local: bool) -> crate::node::outbound::LanVerdict {
    crate::node::outbound::LanVerdict {
        down,
        relay_configured: true,
        local,
        probe_at: T0 + 10_000,
    }
}

/// Only the failed rows' own counts decide the two-failure rule: another row of the peer at
/// two failures does not make one failure of this row a mark; a local failure (sealing) never
/// marks; the second real failure of a row does.
#[test]
fn only_the_failed_rows_count_and_local_failures_never_mark() {
    let (s, lan, failing, _relay) = setup();
    let me = testutil::identity("home");
    let now = T0 + 1_000;
    s.mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET lan_failures = 0 WHERE msg_id = ?1",
                [&lan],
            )?;
            Ok(())
        })
        .unwrap();
    let fail = |id: &str, local: bool| {
        let ids = vec![id.to_string()];
        s.mailbox
            .with(|c| {
                crate::node::outbound::fail_lan_rows(
                    c,
                    &me,
                    "work",
                    &ids,
                    "peer answered 500",
                    verdict(None, local),
                    now,
                )
            })
            .unwrap()
            .marked
    };
    assert!(
        !fail(&lan, false),
        "one failure of this row; another row's count is not its"
    );
    assert!(!fail(&failing, true), "a local failure never marks");
    assert!(peer_state(&s).down_since.is_none());
    assert!(
        fail(&failing, false),
        "the second real failure of a row marks"
    );
    assert_eq!(peer_state(&s).down_reason.as_deref(), Some("failed"));
}

/// A late LAN `rejected:` is never applied (the relay push under way may still deliver the
/// row): it is kept on the row. A late `accepted` settles a row the relay refused.
#[test]
fn a_late_rejection_is_kept_not_applied_and_a_late_accept_beats_a_relay_refusal() {
    let (s, lan, failing, _relay) = setup();
    let me = testutil::identity("home");
    let now = T0 + 1_000;
    s.mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET state = 'rejected', via = NULL, last_error = 'relay: no'
                 WHERE msg_id = ?1",
                [&failing],
            )?;
            Ok(())
        })
        .unwrap();
    let count_messages = || -> i64 {
        s.mailbox
            .with(|c| Ok(c.query_row("SELECT COUNT(*) FROM messages", [], |r| r.get(0))?))
            .unwrap()
    };
    let before = count_messages();
    let results = vec![
        (lan.clone(), "rejected:too big".to_string()),
        (failing.clone(), "accepted".to_string()),
    ];
    let disagreed = s
        .mailbox
        .with(|c| crate::node::outbound::settle_late_lan_batch(c, &me, "work", &results, now))
        .unwrap();
    assert_eq!(disagreed.len(), 2, "{disagreed:?}");
    let row = |id: &str| {
        s.mailbox
            .with(|c| {
                Ok(c.query_row(
                    "SELECT state, via, late_lan_verdict FROM outbox WHERE msg_id = ?1",
                    [id],
                    |r| {
                        Ok((
                            r.get::<_, String>(0)?,
                            r.get::<_, Option<String>>(1)?,
                            r.get::<_, Option<String>>(2)?,
                        ))
                    },
                )?)
            })
            .unwrap()
    };
    let (state, _, late) = row(&lan);
    assert_eq!(state, "pending");
    assert_eq!(late.as_deref(), Some("rejected:too big"));
    assert_eq!(
        count_messages(),
        before,
        "no undelivered alert for a kept rejection"
    );
    let (state, via, late) = row(&failing);
    assert_eq!((state.as_str(), via.as_deref()), ("delivered", Some("lan")));
    assert!(late.is_some());
}

/// Evidence the peer is alive (a hop, presence, mDNS) brings a marked peer's probe forward at
/// most to 5 s from now and never re-times its rows on the relay route; for an unmarked peer
/// it leaves the caller to do as before.
#[test]
fn alive_evidence_brings_the_probe_forward_without_retiming_relay_rows() {
    let (s, _lan, _failing, relay) = setup();
    let now = T0 + 1_000;
    assert_eq!(s.mailbox.with(|c| alive(c, "work", now)).unwrap(), None);
    s.mailbox
        .with(|c| {
            let route = lan_route(c, "work")?;
            mark_down(c, "work", DownReason::Timeout, now, now + 60_000, &route)?;
            Ok(())
        })
        .unwrap();
    let relay_next = next_at(&s, &relay);
    assert_eq!(
        s.mailbox.with(|c| alive(c, "work", now + 1)).unwrap(),
        Some(true)
    );
    assert_eq!(peer_state(&s).probe_at, Some(now + 1 + PROBE_FIRST_MS));
    // A burst of hops does not probe more often.
    for i in 2..50 {
        assert_eq!(
            s.mailbox.with(|c| alive(c, "work", now + i)).unwrap(),
            Some(false)
        );
    }
    assert_eq!(peer_state(&s).probe_at, Some(now + 1 + PROBE_FIRST_MS));
    assert_eq!(
        next_at(&s, &relay),
        relay_next,
        "relay rows keep their backoff"
    );
    assert!(peer_state(&s).down_since.is_some(), "still marked");
}

/// A relay route for the peer exists only with a relay configured and in use and no
/// `target not enrolled` recorded for its pinned key; that refusal lifts a mark (the LAN takes
/// the peer's mail back), and a later relay accept ends it.
#[test]
fn a_relay_route_needs_a_usable_relay_and_an_enrolled_target() {
    let (s, lan, _failing, relay_row) = setup();
    let me = testutil::identity("home");
    let now = T0 + 1_000;
    let route = |relay: bool| s.mailbox.with(|c| relay_route(c, "work", relay)).unwrap();
    assert!(!route(false), "no relay configured");
    assert!(route(true), "relay configured, its state not recorded yet");
    let set_state = |state: &str| {
        s.mailbox
            .with(|c| {
                crate::mailbox::relay_state::kv_set(
                    c,
                    "relay-state:https://relay.example",
                    &format!(r#"{{"state":"{state}","at":"2026-01-01T00:00:00.000Z"}}"#),
                )
            })
            .unwrap()
    };
    set_state("key-mismatch");
    assert!(!route(true), "a relay not in use is no route");
    set_state("ok");
    assert!(route(true));
    s.mailbox
        .with(|c| {
            let r = lan_route(c, "work")?;
            assert!(mark_down(
                c,
                "work",
                DownReason::Refused,
                now,
                now + 5_000,
                &r
            )?);
            Ok(())
        })
        .unwrap();
    // The relay refuses: target not enrolled.
    let failed = s
        .mailbox
        .with(|c| {
            crate::node::outbound::fail_relay_row(
                c,
                &me,
                &relay_row,
                "work",
                "target not enrolled",
                false,
                true,
                now,
            )
        })
        .unwrap();
    assert!(failed.handed_back);
    assert!(peer_state(&s).down_since.is_none(), "the mark is lifted");
    assert!(!route(true), "no relay route for this peer's key");
    // The LAN takes its rows again (the handed-back row once its backoff passed).
    let lan_rows = s
        .mailbox
        .with(|c| outbox::due_for_lan(c, now + 60_000, 100, true))
        .unwrap();
    assert!(lan_rows.iter().any(|r| r.msg_id == lan));
    assert!(lan_rows.iter().any(|r| r.msg_id == relay_row));
    s.mailbox.with(|c| relay_reaches(c, "work")).unwrap();
    assert!(route(true));
}

/// Rows of a peer with a LAN call open are left out inside the query: a busy peer's backlog
/// never fills the pass's limit and starves another peer; so are its receipts.
#[test]
fn a_busy_peer_never_fills_the_limit_of_a_pass() {
    let (s, lan, failing, _relay) = setup();
    let me = testutil::identity("home");
    s.add_peer(&testutil::identity("play"), true);
    s.mailbox
        .with(|c| {
            c.execute(
                "UPDATE peers SET addr = '127.0.0.1:2' WHERE host = 'play'",
                [],
            )?;
            Ok(())
        })
        .unwrap();
    let other = "01KDVDNA3VG2MH8KWSQRCWJZ9Z";
    s.send(&me, "alice", &["bob@play"], "s", other, T0 + 10)
        .unwrap();
    let now = T0 + 10_000;
    let ids = |ex: &[String]| {
        s.mailbox
            .with(|c| outbox::due_for_lan_except(c, now, 2, true, ex))
            .unwrap()
            .into_iter()
            .map(|r| r.msg_id)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ids(&[]),
        vec![lan.clone(), failing.clone()],
        "the busy peer fills the limit"
    );
    assert_eq!(ids(&["work".to_string()]), vec![other.to_string()]);
    let receipts = s
        .mailbox
        .with(|c| {
            crate::mailbox::receipts::due_for_lan_except(c, now, 10, true, &["work".to_string()])
        })
        .unwrap();
    assert!(receipts.iter().all(|r| r.host != "work"));
}
