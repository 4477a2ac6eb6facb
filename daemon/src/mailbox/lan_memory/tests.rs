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
    // The hop path: peer_is_back resets row counts, and the probe comes forward.
    s.mailbox
        .with(|c| {
            outbox::peer_is_back(c, "work", now + 1)?;
            assert!(probe_soon(c, "work", now + 1)?);
            Ok(())
        })
        .unwrap();
    assert_eq!(
        s.mailbox.with(|c| due_probes(c, now + 1)).unwrap(),
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
        .with(|c| probe_failed(c, "work", |n| now + probe_delay_ms(n, 0.5)))
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
