//! The wake brake with explicit times (ms).

use super::*;
use crate::mailbox::Mailbox;

const T0: i64 = 1_800_000_000_000;

struct Box_ {
    _dir: tempfile::TempDir,
    mb: Mailbox,
    n: u32,
}

impl Box_ {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mb = Mailbox::open(&dir.path().join("mailbox.db")).unwrap();
        Box_ {
            _dir: dir,
            mb,
            n: 0,
        }
    }

    /// Delivers a message of `kind` in `thread` to bob; returns its id.
    fn mail(&mut self, kind: &str, thread: &str, needs_reply: bool, body: &str) -> String {
        self.n += 1;
        let id = format!("m{:04}", self.n);
        let env = serde_json::json!({ "needs_reply": needs_reply }).to_string();
        let (id2, thread, kind, body) = (
            id.clone(),
            thread.to_string(),
            kind.to_string(),
            body.to_string(),
        );
        self.mb
            .with(move |c| {
                c.execute(
                    "INSERT INTO messages VALUES (?1,'t','alice@work',?2,NULL,?3,'subject',?4,?5,'local',1)",
                    params![id2, thread, kind, body, env],
                )?;
                c.execute(
                    "INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES (?1,'bob','new',1)",
                    [&id2],
                )?;
                Ok(())
            })
            .unwrap();
        id
    }

    fn claim(&self, ids: &[&str], at: i64) -> Decision {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        self.mb
            .with(move |c| {
                let tx = c.transaction()?;
                let d = claim(&tx, "bob", "home", &ids, at)?;
                tx.commit()?;
                Ok(d)
            })
            .unwrap()
    }
}

fn woke(d: &Decision) -> Vec<String> {
    match d {
        Decision::Wake { messages } => messages.clone(),
        other => panic!("expected a wake, got {other:?}"),
    }
}

#[test]
fn what_wakes_and_status_never_does() {
    let w = |kind: &str, nr: bool, subject: &str, body: &str| {
        is_wake_worthy("bob", "home", kind, nr, subject, body)
    };
    for kind in ["request", "task", "decision", "alert"] {
        assert!(w(kind, false, "s", "b"), "{kind}");
    }
    assert!(!w("message", false, "s", "b"));
    assert!(w("message", true, "s", "b"));
    assert!(w("message", false, "hi @bob", "b"));
    assert!(w("message", false, "s", "ask @bob@home, please"));
    assert!(w("message", false, "s", "(@bob.)"));
    assert!(!w(
        "message",
        false,
        "s",
        "@bobby and mail@bob and @bob@work"
    ));
    assert!(!w("message", false, "s", "@bob@homestead"));
    // status never wakes, whatever else it says.
    assert!(!w("status", true, "@bob", "@bob"));
}

#[test]
fn a_status_message_is_no_wake() {
    let mut b = Box_::new();
    let s = b.mail("status", "th", true, "@bob");
    assert_eq!(b.claim(&[&s], T0), Decision::None);
    let m = b.mail("message", "th", false, "fyi");
    assert_eq!(b.claim(&[&m], T0), Decision::None);
}

#[test]
fn wakes_within_30_s_are_batched_into_the_next() {
    let mut b = Box_::new();
    let a = b.mail("request", "t1", false, "");
    assert_eq!(woke(&b.claim(&[&a], T0)), vec![a.clone()]);
    let c = b.mail("task", "t2", false, "");
    assert_eq!(
        b.claim(&[&c], T0 + 10_000),
        Decision::Batched {
            retry_after_ms: 20_000
        }
    );
    let d = b.mail("alert", "t3", false, "");
    assert!(matches!(
        b.claim(&[&d], T0 + 29_999),
        Decision::Batched { retry_after_ms: 1 }
    ));
    // The carried mail wakes once 30 s passed, with a claim that brings nothing new.
    assert_eq!(woke(&b.claim(&[], T0 + 30_000)), vec![c, d]);
    assert!(matches!(b.claim(&[], T0 + 30_001), Decision::None));
}

#[test]
fn a_thread_wakes_at_most_6_times_an_hour() {
    let mut b = Box_::new();
    let step = BATCH_MS;
    for i in 0..6 {
        let m = b.mail("request", "busy", false, "");
        assert_eq!(woke(&b.claim(&[&m], T0 + i * step)).len(), 1, "wake {i}");
    }
    let m = b.mail("request", "busy", false, "");
    assert_eq!(b.claim(&[&m], T0 + 6 * step), Decision::ThreadCap);
    // Another thread still wakes; the capped one does again an hour after its first wake.
    let other = b.mail("request", "quiet", false, "");
    assert_eq!(woke(&b.claim(&[&other], T0 + 7 * step)), vec![other]);
    let m = b.mail("request", "busy", false, "");
    assert_eq!(woke(&b.claim(&[&m], T0 + HOUR_MS + 1)), vec![m]);
}

#[test]
fn an_agent_wakes_at_most_60_times_a_day() {
    let mut b = Box_::new();
    for i in 0..60 {
        let m = b.mail("request", &format!("t{i}"), false, "");
        assert_eq!(
            woke(&b.claim(&[&m], T0 + i * BATCH_MS)).len(),
            1,
            "wake {i}"
        );
    }
    let m = b.mail("request", "t60", false, "");
    assert_eq!(b.claim(&[&m], T0 + 60 * BATCH_MS), Decision::DailyCap);
    let m = b.mail("request", "t61", false, "");
    assert_eq!(woke(&b.claim(&[&m], T0 + DAY_MS + 1)), vec![m]);
    // Wakes older than 24 h are pruned (the first one's time was T0).
    let left: i64 =
        b.mb.with(|c| Ok(c.query_row("SELECT COUNT(*) FROM wakes", [], |r| r.get(0))?))
            .unwrap();
    assert_eq!(left, 60);
}

#[test]
fn mute_and_unmute() {
    let mut b = Box_::new();
    let until = b.mb.with(|c| mute(c, "bob", 5, T0)).unwrap();
    assert_eq!(until, T0 + 5 * 60_000);
    let m = b.mail("request", "t", false, "");
    assert_eq!(b.claim(&[&m], T0 + 1), Decision::Muted { until_ms: until });
    // Muted mail does not wake later either; new mail after the mute ends does.
    let n = b.mail("request", "t", false, "");
    assert_eq!(woke(&b.claim(&[&n], until)), vec![n]);
    b.mb.with(|c| mute(c, "bob", 60, T0 + HOUR_MS)).unwrap();
    assert!(b.mb.with(|c| unmute(c, "bob")).unwrap());
    assert!(!b.mb.with(|c| unmute(c, "bob")).unwrap());
    let k = b.mail("request", "t2", false, "");
    assert_eq!(woke(&b.claim(&[&k], T0 + HOUR_MS + 1)), vec![k]);
    for bad in [0, MAX_MUTE_MINUTES + 1] {
        assert!(matches!(
            b.mb.with(|c| mute(c, "bob", bad, T0)),
            Err(MailboxError::Invalid(_))
        ));
    }
}

#[test]
fn two_claimers_of_the_same_mail_make_one_wake() {
    let mut b = Box_::new();
    let m = b.mail("request", "t", false, "");
    let first = b.claim(&[&m], T0);
    let second = b.claim(&[&m], T0);
    assert_eq!(woke(&first), vec![m]);
    assert_eq!(second, Decision::None);
    // Mail of another agent or an unknown id is not claimed.
    assert_eq!(b.claim(&["nope"], T0 + BATCH_MS), Decision::None);
}
