//! The writer: group commit, failpoints, failed requests and a failed COMMIT.

use super::*;

#[test]
fn concurrent_pushes_all_get_correct_replies_with_fewer_commits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(open(dir.path()));
    let beta = key(2);
    enrol(&store, &beta, "beta");
    let senders: Vec<String> = (10..18).map(key).collect();
    for (i, s) in senders.iter().enumerate() {
        enrol(&store, s, &format!("s{i}"));
    }
    let before = store.stats();
    const PER: usize = 25;
    let threads: Vec<_> = senders
        .iter()
        .cloned()
        .map(|sender| {
            let store = Arc::clone(&store);
            let beta = beta.clone();
            std::thread::spawn(move || {
                (0..PER)
                    .map(|i| {
                        let wire = format!("{sender}/{i}").into_bytes();
                        let o = push_one(
                            &store,
                            &sender,
                            1_000,
                            item(&format!("i{i}"), &[(&beta, &wire)]),
                        );
                        assert_eq!(o.status, ItemStatus::Accepted);
                        assert_eq!(o.targets[0].wire_hash, wire_hash(&wire));
                        (o.targets[0].seq, sender.clone(), i)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut replies: Vec<(i64, String, usize)> = Vec::new();
    for t in threads {
        replies.extend(t.join().expect("join"));
    }
    let requests = (senders.len() * PER) as u64;
    let after = store.stats();
    assert_eq!(after.write_requests - before.write_requests, requests);
    let commits = after.commits - before.commits;
    assert!(
        commits >= 1 && commits <= requests,
        "{commits} commits for {requests} requests"
    );
    assert_eq!(after.queued, 0);

    // Every reply names a distinct seq, and each seq holds exactly that sender's item.
    let page = pull_all(&store, &beta);
    assert_eq!(page.items.len() as u64, requests, "all stored once");
    let mut seqs: Vec<i64> = replies.iter().map(|r| r.0).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len() as u64, requests);
    for (seq, sender, i) in &replies {
        let it = page.items.iter().find(|p| p.seq == *seq).expect("stored");
        assert_eq!(&it.sender_pubkey, sender);
        assert_eq!(it.item_id, format!("i{i}"));
        assert_eq!(it.wire, format!("{sender}/{i}").into_bytes());
    }
}

static GATE_OPEN: Mutex<bool> = Mutex::new(false);
static GATE: Condvar = Condvar::new();
static GATE_HITS: AtomicUsize = AtomicUsize::new(0);

/// Holds the writer at its first `push:before-commit` until the test opens the gate.
fn gate_failpoint(name: &str) {
    if name == "push:before-commit" && GATE_HITS.fetch_add(1, Ordering::SeqCst) == 0 {
        let mut open = GATE_OPEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while !*open {
            open = GATE
                .wait(open)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

fn open_gate() {
    *GATE_OPEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
    GATE.notify_all();
}

/// Opens the gate when dropped, so a failing assertion cannot leave the writer blocked (and
/// the store's drop waiting for it forever).
struct GateGuard;

impl Drop for GateGuard {
    fn drop(&mut self) {
        open_gate();
    }
}

#[test]
fn writer_answers_goes_through_the_writer_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options()).expect("open");
    let (epoch, base) = (store.epoch().expect("epoch"), store.stats());
    store.writer_answers().expect("the writer answers");
    let after = store.stats();
    assert_eq!(after.write_requests, base.write_requests + 1);
    assert_eq!(after.groups, base.groups + 1);
    assert_eq!(store.epoch().expect("epoch"), epoch);
    assert_eq!(store.heartbeat().expect("heartbeat"), None);
    store.close().expect("close");
}

#[test]
fn waiting_requests_share_one_commit_and_nothing_is_visible_or_answered_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(
        SqliteStore::open_with(
            dir.path(),
            &relay_key(),
            1_000,
            OpenOptions {
                failpoint: gate_failpoint,
                ..options()
            },
        )
        .expect("open"),
    );
    let (alpha, beta) = alpha_and_beta(&store);
    let base = store.stats();
    let _guard = GateGuard;

    let spawn_push = |i: usize| {
        let store = Arc::clone(&store);
        let (alpha, beta) = (alpha.clone(), beta.clone());
        std::thread::spawn(move || {
            push_one(
                &store,
                &alpha,
                1_000,
                item(&format!("m{i}"), &[(&beta, format!("w{i}").as_bytes())]),
            )
        })
    };
    // Group 1: one push, held between apply and COMMIT.
    let first = spawn_push(0);
    wait_until("the writer to reach push:before-commit", || {
        GATE_HITS.load(Ordering::SeqCst) == 1
    });
    assert!(
        pull_all(&store, &beta).items.is_empty(),
        "uncommitted rows are invisible"
    );
    assert_eq!(store.info_for(&beta).expect("info").head_seq, 0);
    assert!(!first.is_finished(), "no reply before COMMIT");

    // Meanwhile 31 more pushes queue up.
    const MORE: usize = 31;
    let rest: Vec<_> = (1..=MORE).map(spawn_push).collect();
    wait_until("all pushes to queue", || store.stats().queued == MORE);
    open_gate();

    let mut outcomes = vec![first.join().expect("join")];
    outcomes.extend(rest.into_iter().map(|t| t.join().expect("join")));
    assert!(outcomes.iter().all(|o| o.status == ItemStatus::Accepted));
    let stats = store.stats();
    assert_eq!(stats.write_requests - base.write_requests, 1 + MORE as u64);
    assert_eq!(
        stats.commits - base.commits,
        2,
        "the 31 waiting pushes shared one commit"
    );
    assert_eq!(
        GATE_HITS.load(Ordering::SeqCst),
        2,
        "one failpoint hit per group"
    );
    let page = pull_all(&store, &beta);
    assert_eq!(page.items.len(), 1 + MORE);
    for o in &outcomes {
        let it = page
            .items
            .iter()
            .find(|p| p.seq == o.targets[0].seq)
            .expect("stored");
        assert_eq!(it.item_id, o.item_id);
    }
}

static FAILPOINT_LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());
static FAILPOINT_ARMED: AtomicBool = AtomicBool::new(false);

fn recording_failpoint(name: &str) {
    if FAILPOINT_ARMED.load(Ordering::SeqCst) {
        FAILPOINT_LOG
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(name.to_owned());
    }
}

#[test]
fn failpoints_are_hit_at_the_commit_boundaries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open_with(
        dir.path(),
        &relay_key(),
        1_000,
        OpenOptions {
            failpoint: recording_failpoint,
            ..options()
        },
    )
    .expect("open");
    let (alpha, beta) = alpha_and_beta(&store);
    FAILPOINT_ARMED.store(true, Ordering::SeqCst);
    let o = push_one(&store, &alpha, 1_000, item("m", &[(&beta, b"x")]));
    store
        .ack(AckRequest {
            target_pubkey: beta.clone(),
            through: o.targets[0].seq,
            epoch: None,
        })
        .expect("ack");
    store.set_heartbeat(5).expect("heartbeat");
    FAILPOINT_ARMED.store(false, Ordering::SeqCst);
    let log = FAILPOINT_LOG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    assert_eq!(
        log,
        [
            "push:before-commit",
            "push:after-commit",
            "ack:before-commit",
            "ack:after-commit"
        ]
    );
}

#[test]
fn a_failed_request_leaves_nothing_and_does_not_disturb_its_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    // A request that writes, then fails: its savepoint is rolled back.
    let err = store
        .submit(JobKind::Other, |c, _| -> Result<(), StoreError> {
            meta_put(c, "half", "written")?;
            Err(StoreError::InvalidInput("boom".to_owned()))
        })
        .expect_err("fails");
    assert!(matches!(err, StoreError::InvalidInput(_)));
    assert_eq!(store.meta("half").expect("meta"), None);
    // The store keeps working.
    let o = push_one(&store, &alpha, 1_000, item("m", &[(&beta, b"x")]));
    assert_eq!(o.status, ItemStatus::Accepted);
}

/// Runs, in one group, a request that writes meta `other` and then a push running `push`;
/// returns `(other's result, push's result)`.
fn group_of_other_and_push(
    store: &SqliteStore,
    push: fn(&Connection) -> Result<(), StoreError>,
) -> (Result<(), StoreError>, Result<(), StoreError>) {
    // Hold the writer in a first group until the next two requests are queued, so both
    // land in one group.
    let (release, held) = mpsc::channel::<()>();
    let (started_tx, started) = mpsc::channel::<()>();
    let (first_done, first) = mpsc::channel();
    store.submit_then(
        JobKind::Other,
        move |_, _| -> Result<(), StoreError> {
            let _ = started_tx.send(());
            held.recv().map_err(|_| StoreError::WriterStopped)
        },
        Box::new(move |r| {
            let _ = first_done.send(r);
        }),
    );
    started.recv().expect("the writer runs the first request");
    let (other_done, other) = mpsc::channel();
    store.submit_then(
        JobKind::Other,
        |c, _| meta_put(c, "other", "written"),
        Box::new(move |r| {
            let _ = other_done.send(r);
        }),
    );
    let (push_done, push_result) = mpsc::channel();
    store.submit_then(
        JobKind::Push,
        move |c, _| push(c),
        Box::new(move |r| {
            let _ = push_done.send(r);
        }),
    );
    release.send(()).expect("release the writer");
    first
        .recv()
        .expect("first answered")
        .expect("first group commits");
    (
        other.recv().expect("other answered"),
        push_result.recv().expect("push answered"),
    )
}

#[test]
fn a_push_that_fails_part_way_fails_its_whole_group_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let committed_before = store.stats().commits;
    let (other, push) = group_of_other_and_push(&store, |c| {
        meta_put(c, "half", "written")?;
        Err(StoreError::InvalidInput("boom".to_owned()))
    });
    let push_err = push.expect_err("push fails");
    assert!(
        matches!(push_err, StoreError::InvalidInput(_)),
        "{push_err}"
    );
    let other_err = other.expect_err("group fails");
    assert!(
        matches!(other_err, StoreError::NotCommitted { .. }),
        "{other_err}"
    );
    assert_eq!(store.meta("half").expect("meta"), None);
    assert_eq!(store.meta("other").expect("meta"), None);
    assert_eq!(store.stats().commits, committed_before + 1);
    // The writer keeps working: a push after it is stored.
    let o = push_one(&store, &alpha, 1_000, item("m", &[(&beta, b"x")]));
    assert_eq!(o.status, ItemStatus::Accepted);
    assert_eq!(store.failed(), None);
}

#[test]
fn a_push_that_fails_before_writing_fails_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let committed_before = store.stats().commits;
    let (other, push) = group_of_other_and_push(&store, |c| {
        read_epoch(c)?;
        Err(StoreError::InvalidInput("boom".to_owned()))
    });
    let push_err = push.expect_err("push fails");
    assert!(
        matches!(push_err, StoreError::InvalidInput(_)),
        "{push_err}"
    );
    other.expect("the rest of the group commits");
    assert_eq!(
        store.meta("other").expect("meta").as_deref(),
        Some("written")
    );
    assert_eq!(store.stats().commits, committed_before + 2);
    assert_eq!(store.failed(), None);
}

/// A write whose COMMIT fails for real: a deferred foreign key violated inside the
/// transaction is only checked by COMMIT (the statements and the savepoint succeed).
fn fail_the_commit(store: &SqliteStore) -> StoreError {
    store
        .submit(JobKind::Other, |c, _| -> Result<(), StoreError> {
            c.execute_batch(
                "CREATE TEMP TABLE IF NOT EXISTS fk_parent (id INTEGER PRIMARY KEY);
                 CREATE TEMP TABLE IF NOT EXISTS fk_child (
                   parent INTEGER REFERENCES fk_parent(id) DEFERRABLE INITIALLY DEFERRED);
                 INSERT INTO fk_child (parent) VALUES (1);",
            )?;
            meta_put(c, "doomed", "written")?;
            Ok(())
        })
        .expect_err("the COMMIT fails")
}

#[test]
fn a_failed_commit_stops_the_writer_for_good() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    let kept = push_one(&store, &alpha, 1_000, item("kept", &[(&beta, b"k")]));
    assert_eq!(store.failed(), None);
    let commits = store.commits();

    let err = fail_the_commit(&store);
    assert!(
        matches!(&err, StoreError::NotCommitted { reason } if reason.starts_with("COMMIT failed")),
        "{err}"
    );
    let reason = store.failed().expect("the store reports the failure");
    assert!(reason.starts_with("COMMIT failed"), "{reason}");
    assert_eq!(store.commits(), commits, "nothing committed");

    // Every later write fails at once with a clear error, whatever it is.
    let push = store.push(crate::testing::conformance::batch(
        &alpha,
        "alpha",
        2_000,
        Expiry::Retention,
        vec![item("late", &[(&beta, b"l")])],
    ));
    let writes = [
        push.map(drop),
        store.set_heartbeat(2_000),
        store.set_meta("k", "v"),
        store.revoke(&beta, 2_000).map(drop),
        store
            .ack(AckRequest {
                target_pubkey: beta.clone(),
                through: 0,
                epoch: None,
            })
            .map(drop),
    ];
    for w in writes {
        match w {
            Err(e @ StoreError::WriterFailed { .. }) => {
                let text = e.to_string();
                assert!(text.contains("COMMIT failed"), "{text}");
                assert!(text.contains("restart the relay"), "{text}");
            }
            other => panic!("a write after the failure: {other:?}"),
        }
    }
    assert_eq!(store.commits(), commits, "the writer tried nothing more");
    // Reads still see the last committed state, and nothing of the failed group.
    assert_eq!(store.meta("doomed").expect("meta"), None);
    let page = pull_all(&store, &beta);
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].seq, kept.targets[0].seq);
    assert!(format!("{store:?}").contains("COMMIT failed"));

    // A restart (a new open after recovery) writes again.
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.failed(), None);
    let o = push_one(&store, &alpha, 3_000, item("after", &[(&beta, b"a")]));
    assert_eq!(o.status, ItemStatus::Accepted);
    assert_eq!(store.meta("doomed").expect("meta"), None);
}

#[test]
fn requests_queued_behind_a_failed_commit_are_refused_not_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(open(dir.path()));
    let (alpha, beta) = alpha_and_beta(&store);
    // Many writers race the failing one: each gets either its committed result (before the
    // failure) or an error (in the failing group, or after it); none is applied afterwards.
    let racers: Vec<_> = (0..16)
        .map(|i| {
            let store = Arc::clone(&store);
            let (alpha, beta) = (alpha.clone(), beta.clone());
            std::thread::spawn(move || {
                store.push(crate::testing::conformance::batch(
                    &alpha,
                    "alpha",
                    1_000,
                    Expiry::Retention,
                    vec![item(&format!("r{i}"), &[(&beta, b"r")])],
                ))
            })
        })
        .collect();
    let err = fail_the_commit(&store);
    assert!(matches!(err, StoreError::NotCommitted { .. }), "{err}");
    let mut ok = 0;
    for r in racers {
        match r.join().expect("join") {
            Ok(out) => {
                assert_eq!(out.items[0].status, ItemStatus::Accepted);
                ok += 1;
            }
            Err(StoreError::NotCommitted { .. } | StoreError::WriterFailed { .. }) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert_eq!(
        pull_all(&store, &beta).items.len(),
        ok,
        "exactly the answered ones"
    );
    assert!(matches!(
        store.set_heartbeat(5),
        Err(StoreError::WriterFailed { .. })
    ));
}

#[test]
fn a_reply_callback_that_panics_after_the_commit_leaves_the_writer_and_the_group_answered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (alpha, beta) = alpha_and_beta(&store);
    // Hold the writer in a first group until the next two requests are queued, so both land
    // in one group: the first one's callback panics, the second must still get its reply.
    let (release, held) = mpsc::channel::<()>();
    let (started_tx, started) = mpsc::channel::<()>();
    store.submit_then(
        JobKind::Other,
        move |_, _| -> Result<(), StoreError> {
            let _ = started_tx.send(());
            held.recv().map_err(|_| StoreError::WriterStopped)
        },
        Box::new(|_| {}),
    );
    started.recv().expect("the writer runs the first request");
    store.submit_then(
        JobKind::Other,
        |c, _| meta_put(c, "panicky", "written"),
        Box::new(|_| panic!("a reply callback panics")),
    );
    let (after_done, after) = mpsc::channel();
    store.submit_then(
        JobKind::Other,
        |c, _| meta_put(c, "after", "written"),
        Box::new(move |r| {
            let _ = after_done.send(r);
        }),
    );
    release.send(()).expect("release the writer");
    after
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the rest of the group is answered")
        .expect("and committed");
    assert_eq!(
        store.meta("panicky").expect("meta").as_deref(),
        Some("written")
    );
    assert_eq!(store.failed(), None);
    // The writer goes on.
    let o = push_one(&store, &alpha, 1_000, item("m", &[(&beta, b"x")]));
    assert_eq!(o.status, ItemStatus::Accepted);
}
