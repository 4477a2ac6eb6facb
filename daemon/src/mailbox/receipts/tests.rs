use super::*;
use crate::mailbox::{messages, outbox};
use crate::testutil::{self, T0};

const ID: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";

fn row(note: Option<&str>) -> Row {
    Row {
        seq: 7,
        msg_id: ID.into(),
        agent: "bob".into(),
        host: "home".into(),
        state: "acked".into(),
        note: note.map(String::from),
        at: T0,
        attempts: 0,
        lan_failures: 0,
        next_at: T0,
        wire: None,
        target_pubkey: None,
    }
}

#[test]
fn the_record_names_this_host_and_omits_an_empty_note() {
    let r = record(&row(Some("")), "work");
    assert_eq!(r.recipient, "bob@work");
    assert_eq!(r.at, "2026-01-01T00:01:00.000Z");
    assert_eq!((r.note.clone(), r.did.clone(), r.seq), (None, None, 7));
    assert_eq!(r.item_id(), format!("receipt:{ID}:bob@work:7"));
    // A note is cut to 500 UTF-16 units (an astral character counts two).
    let long = "😀".repeat(300);
    let r = record(&row(Some(&long)), "work");
    assert_eq!(utf16_len(r.note.as_deref().unwrap()), 500);
    let key = testutil::identity("work").host_key;
    let wire = r.wire(&key).unwrap();
    assert!(agentmbx_protocol::records::parse_receipt_wire(wire.as_bytes(), &key.public()).is_ok());
}

/// Issue 17 (9): when the LAN failed (`last_error`) and the relay is not working either, a
/// queued recipient also shows the relay's standing; a working relay, or none, adds nothing.
#[test]
fn a_queued_recipient_shows_the_relay_state_when_the_relay_fails_too() {
    let s = testutil::store();
    let me = testutil::identity("home");
    s.register("home", &["bob"]);
    s.add_peer(&testutil::identity("work"), true);
    let m1 = testutil::ids().next(T0);
    s.send(&me, "alice", &["dan@work", "bob"], "one", &m1, T0)
        .unwrap();
    let relay_of = |s: &testutil::Store| {
        let page = s
            .mailbox
            .with(|c| sent_page(c, "alice", "home", None, 20))
            .unwrap();
        page.messages[0]
            .recipients
            .iter()
            .map(|r| (r.recipient.clone(), r.last_error.clone(), r.relay.clone()))
            .collect::<Vec<_>>()
    };
    let lan = "cannot connect: Connection refused (os error 111)";
    s.mailbox
        .with(|c| outbox::fail_lan(c, &m1, "work", lan, T0 + 1).map(|_| ()))
        .unwrap();
    // No relay used: the LAN error alone.
    assert_eq!(
        relay_of(&s)[0],
        ("dan@work".to_string(), Some(lan.to_string()), None)
    );
    let set = |url: &str, v: serde_json::Value| {
        s.mailbox
            .with(|c| {
                crate::mailbox::relay_state::kv_set(
                    c,
                    &format!("relay-state:{url}"),
                    &v.to_string(),
                )
            })
            .unwrap()
    };
    set(
        "https://relay.example",
        serde_json::json!({"state": "unreachable", "at": "2026-01-01T00:00:00.000Z",
                "detail": "cannot connect: the relay does not speak TLS at this address"}),
    );
    let got = relay_of(&s);
    assert_eq!(got[1].2, None, "a local recipient: {got:?}");
    assert_eq!(
        got[0],
        (
            "dan@work".to_string(),
            Some(lan.to_string()),
            Some(
                "unreachable since 2026-01-01T00:00:00.000Z: cannot connect: the relay does \
                     not speak TLS at this address"
                    .to_string()
            )
        )
    );
    let page = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let json = serde_json::to_value(&page.messages[0].recipients[0]).unwrap();
    assert!(json["relay"]
        .as_str()
        .unwrap()
        .starts_with("unreachable since"));
    // The relay works again: nothing more to say.
    set(
        "https://relay.example",
        serde_json::json!({"state": "ok", "at": "2026-01-01T00:01:00.000Z"}),
    );
    assert_eq!(relay_of(&s)[0].2, None);
}

#[test]
fn a_queued_recipient_shows_the_last_error_cut_to_120_characters() {
    let s = testutil::store();
    let me = testutil::identity("home");
    for h in ["work", "lab", "sea"] {
        s.add_peer(&testutil::identity(h), true);
    }
    let m1 = testutil::ids().next(T0);
    s.send(
        &me,
        "alice",
        &["dan@work", "fay@lab", "gus@sea"],
        "one",
        &m1,
        T0,
    )
    .unwrap();
    let at_limit = "e".repeat(MAX_SENT_ERROR_CHARS);
    let past = format!("{}é", "x".repeat(MAX_SENT_ERROR_CHARS));
    s.mailbox
        .with(|c| {
            // work: one failed relay attempt; lab: an error exactly at the limit; sea: a
            // longer one (cut), and the row then ends undelivered (the reason, no last_error).
            outbox::fail(
                c,
                &m1,
                "work",
                "rejected:target not enrolled",
                false,
                T0 + 1,
            )?;
            c.execute(
                "UPDATE outbox SET last_error = ?1 WHERE host = 'lab'",
                [&at_limit],
            )?;
            c.execute(
                "UPDATE outbox SET last_error = ?1 WHERE host = 'sea'",
                [&past],
            )?;
            Ok(())
        })
        .unwrap();
    let page = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let got: Vec<(&str, &str, Option<&str>)> = page.messages[0]
        .recipients
        .iter()
        .map(|r| {
            (
                r.recipient.as_str(),
                r.state.as_str(),
                r.last_error.as_deref(),
            )
        })
        .collect();
    let cut = format!("{}…", "x".repeat(MAX_SENT_ERROR_CHARS - 1));
    assert_eq!(
        got,
        vec![
            ("dan@work", "queued", Some("rejected:target not enrolled")),
            ("fay@lab", "queued", Some(at_limit.as_str())),
            ("gus@sea", "queued", Some(cut.as_str())),
        ]
    );
    assert_eq!(cut.chars().count(), MAX_SENT_ERROR_CHARS);
    let json = serde_json::to_value(&page.messages[0].recipients[0]).unwrap();
    assert_eq!(json["last_error"], "rejected:target not enrolled");
    // Undelivered: the reason, and no last_error; no failure yet: no last_error at all.
    s.mailbox
            .with(|c| {
                c.execute(
                    "UPDATE outbox SET state = 'undelivered', last_error = 'gave up after 72 h (x)' WHERE host = 'sea'",
                    [],
                )?;
                c.execute("UPDATE outbox SET last_error = NULL WHERE host = 'lab'", [])?;
                Ok(())
            })
            .unwrap();
    let page = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let r = &page.messages[0].recipients;
    assert_eq!(
        (r[1].state.as_str(), r[1].last_error.as_deref()),
        ("queued", None)
    );
    let json = serde_json::to_value(&r[1]).unwrap();
    assert!(json.get("last_error").is_none(), "{json}");
    assert_eq!(
        (
            r[2].state.as_str(),
            r[2].reason.as_deref(),
            r[2].last_error.as_deref()
        ),
        ("undelivered", Some("gave up after 72 h (x)"), None)
    );
}

#[test]
fn sent_shows_each_recipient_newest_message_first() {
    let s = testutil::store();
    let me = testutil::identity("home");
    s.register("home", &["bob", "carol"]);
    s.add_peer(&testutil::identity("work"), true);
    s.add_peer(&testutil::identity("lab"), true);
    s.add_peer(&testutil::identity("sea"), true);
    s.add_peer(&testutil::identity("sky"), true);
    let mut ids = testutil::ids();
    let m1 = ids.next(T0);
    let m2 = ids.next(T0);
    s.send(
        &me,
        "alice",
        &[
            "bob",
            "carol@home",
            "dan@work",
            "eve@work",
            "fay@lab",
            "gus@sea",
            "hal@sky",
        ],
        "one",
        &m1,
        T0,
    )
    .unwrap();
    s.send(&me, "alice", &["bob"], "two", &m2, T0 + 5).unwrap();
    // Someone else's mail and an alert to alice are not alice's sent mail.
    s.send(&me, "zed", &["bob"], "not alice's", &ids.next(T0), T0)
        .unwrap();
    s.mailbox
            .with(|c| {
                messages::read(c, "bob", "home", &m1, T0 + 1)?;
                messages::ack(c, "carol", std::slice::from_ref(&m1), None, T0 + 2)?;
                // work: a receipt for dan; eve has none yet and the row is relay-accepted.
                c.execute(
                    "UPDATE outbox SET state = 'relay-accepted', accepted_at = 1, via = 'relay' WHERE host = 'work'",
                    [],
                )?;
                c.execute(
                    "INSERT INTO remote_receipts(msg_id, recipient, host, state, at, seq, record, sig, received_at)
                     VALUES (?1, 'dan@work', 'work', 'read', '2026-01-01T00:02:00.000Z', 3, '{}', 's', 0)",
                    [&m1],
                )?;
                c.execute(
                    "UPDATE outbox SET state = 'delivered', via = 'lan', settled_at = ?1 WHERE host = 'lab'",
                    [T0 + 3],
                )?;
                c.execute(
                    "UPDATE outbox SET state = 'undelivered', last_error = 'gave up after 72 h (x)' WHERE host = 'sea'",
                    [],
                )?;
                crate::node::alert::undelivered(c, &me, &m1, "sea", "x", T0 + 4)?;
                Ok(())
            })
            .unwrap();
    let page = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", None, 20))
        .unwrap();
    assert_eq!(page.next_cursor, None);
    let ids_got: Vec<&str> = page.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids_got, vec![m2.as_str(), m1.as_str()]);
    type Line<'a> = (&'a str, &'a str, &'a str, Option<&'a str>, Option<&'a str>);
    let got: Vec<Line<'_>> = page.messages[1]
        .recipients
        .iter()
        .map(|r| {
            (
                r.recipient.as_str(),
                r.host.as_str(),
                r.state.as_str(),
                r.reason.as_deref(),
                r.via.as_deref(),
            )
        })
        .collect();
    assert_eq!(
            got,
            vec![
                ("bob@home", "home", "read", None, None),
                ("carol@home", "home", "acked", None, None),
                ("dan@work", "work", "read", None, Some("relay")),
                ("eve@work", "work", "relay-accepted", None, Some("relay")),
                // The host took it over the LAN; no receipt from fay: not `delivered`.
                (
                    "fay@lab",
                    "lab",
                    "accepted",
                    Some("lab has it; no delivered receipt from fay yet (lab holds mail for an agent it does not have until one registers as fay)"),
                    Some("lan")
                ),
                (
                    "gus@sea",
                    "sea",
                    "undelivered",
                    Some("gave up after 72 h (x)"),
                    None
                ),
                ("hal@sky", "sky", "queued", None, None),
            ]
        );
    assert_eq!(page.messages[0].recipients[0].state, "delivered");
    // Paging: one per page, newest first, then the end.
    let p1 = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", None, 1))
        .unwrap();
    assert_eq!(p1.messages[0].id, m2);
    let p2 = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", p1.next_cursor.as_deref(), 1))
        .unwrap();
    assert_eq!(p2.messages[0].id, m1);
    assert_eq!(p2.next_cursor, None);
    assert!(matches!(
        s.mailbox
            .with(|c| sent_page(c, "alice", "home", Some("junk"), 1)),
        Err(MailboxError::Invalid(_))
    ));
    // An agent that sent nothing.
    let empty = s
        .mailbox
        .with(|c| sent_page(c, "nobody", "home", None, 20))
        .unwrap();
    assert!(empty.messages.is_empty());
}

/// Case `clock-fix-does-not-release-mail`: a message sent while the clock was 10 min ahead
/// (its send time and id are from the skewed clock) does not stay at the top of `sent` once
/// the clock is right: the list and its cursor follow the order this host stored them in.
#[test]
fn sent_orders_by_local_insertion_not_by_times_a_clock_ahead_wrote() {
    const SKEW: i64 = 600_000;
    let s = testutil::store();
    let me = testutil::identity("home");
    s.register("home", &["bob"]);
    let mut ids = testutil::ids();
    let skewed = ids.next(T0 + SKEW);
    s.send(
        &me,
        "alice",
        &["bob"],
        "during the skew",
        &skewed,
        T0 + SKEW,
    )
    .unwrap();
    let (after1, after2) = (ids.next(T0), ids.next(T0 + 1));
    s.send(&me, "alice", &["bob"], "after the fix", &after1, T0)
        .unwrap();
    s.send(&me, "alice", &["bob"], "later", &after2, T0 + 1)
        .unwrap();
    let newest_first = vec![after2.clone(), after1.clone(), skewed.clone()];
    let page = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let got: Vec<String> = page.messages.iter().map(|m| m.id.clone()).collect();
    assert_eq!(got, newest_first);
    // One per page: the cursor follows the same order, then the end.
    let mut paged = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let p = s
            .mailbox
            .with(|c| sent_page(c, "alice", "home", cursor.as_deref(), 1))
            .unwrap();
        paged.extend(p.messages.iter().map(|m| m.id.clone()));
        match p.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
        assert!(paged.len() <= 3, "the cursor ends");
    }
    assert_eq!(paged, newest_first);
}

#[test]
fn sent_shows_hosts_reached_by_a_bare_name_a_broadcast_or_a_role() {
    let s = testutil::store();
    let me = testutil::identity("home");
    s.add_peer(&testutil::identity("work"), true);
    s.add_peer(&testutil::identity("lab"), true);
    s.mailbox
        .with(|c| {
            c.execute(
                "INSERT INTO agents(name, host, last_seen) VALUES ('bob', 'work', 1)",
                [],
            )?;
            Ok(())
        })
        .unwrap();
    let mut ids = testutil::ids();
    let (m1, m2, m3) = (ids.next(T0), ids.next(T0), ids.next(T0));
    // bob lives on work only: the bare name went there.
    s.send(&me, "alice", &["bob"], "bare", &m1, T0).unwrap();
    s.send(&me, "alice", &["*"], "all", &m2, T0 + 1).unwrap();
    s.send(&me, "alice", &["role:dev"], "devs", &m3, T0 + 2)
        .unwrap();
    s.mailbox
            .with(|c| {
                // m2: relay-accepted at work, given up at lab.
                c.execute(
                    "UPDATE outbox SET state = 'relay-accepted', accepted_at = 1, via = 'relay'
                     WHERE msg_id = ?1 AND host = 'work'",
                    [&m2],
                )?;
                c.execute(
                    "UPDATE outbox SET state = 'undelivered', settled_at = ?2,
                       last_error = 'gave up after 72 h (no transport could take it)'
                     WHERE msg_id = ?1 AND host = 'lab'",
                    rusqlite::params![m2, T0 + 9],
                )?;
                // m3: a receipt from work already names its recipient there; lab took it.
                c.execute(
                    "INSERT INTO remote_receipts(msg_id, recipient, host, state, at, seq, record, sig, received_at)
                     VALUES (?1, 'carl@work', 'work', 'delivered', '2026-01-01T00:02:00.000Z', 1, '{}', 's', 0)",
                    [&m3],
                )?;
                c.execute(
                    "UPDATE outbox SET state = 'delivered', via = 'lan', settled_at = ?2
                     WHERE msg_id = ?1 AND host = 'lab'",
                    rusqlite::params![m3, T0 + 3],
                )?;
                Ok(())
            })
            .unwrap();
    let page = s
        .mailbox
        .with(|c| sent_page(c, "alice", "home", None, 20))
        .unwrap();
    type Line = (String, String, String, Option<String>, Option<String>);
    let lines = |id: &str| -> Vec<Line> {
        page.messages
            .iter()
            .find(|m| m.id == id)
            .expect("listed")
            .recipients
            .iter()
            .map(|r| {
                (
                    r.recipient.clone(),
                    r.host.clone(),
                    r.state.clone(),
                    r.reason.clone(),
                    r.via.clone(),
                )
            })
            .collect()
    };
    let line = |r: &str, h: &str, st: &str, why: Option<&str>, via: Option<&str>| {
        (
            r.to_string(),
            h.to_string(),
            st.to_string(),
            why.map(String::from),
            via.map(String::from),
        )
    };
    assert_eq!(
        lines(&m1),
        vec![line("bob@work", "work", "queued", None, None)]
    );
    assert_eq!(
        lines(&m2),
        vec![
            line(
                "*@lab",
                "lab",
                "undelivered",
                Some("gave up after 72 h (no transport could take it)"),
                None
            ),
            line("*@work", "work", "relay-accepted", None, Some("relay")),
        ]
    );
    assert_eq!(
        lines(&m3),
        vec![
            line("carl@work", "work", "delivered", None, None),
            line("role:dev@lab", "lab", "delivered", None, Some("lan")),
        ]
    );
    // The settled time of the row is shown.
    let m2_lab = &page
        .messages
        .iter()
        .find(|m| m.id == m2)
        .unwrap()
        .recipients[0];
    assert_eq!(m2_lab.at, Some(iso_ms(T0 + 9)));
}
