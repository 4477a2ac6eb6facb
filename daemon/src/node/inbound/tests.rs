//! Unit tests of the inbound path: duplicates re-queue receipts, a refused item of a LAN batch
//! rolls back only its savepoint, the caller's `after` writes commit with their item, and the
//! wake follows the commit.

use super::*;
use crate::mailbox::peers;
use crate::testutil::{self, Store, T0};

/// `home` (bob registered) pinned `work`; envelopes from ann@work to bob@home.
struct Fx {
    store: Store,
    me: Arc<Identity>,
    work: Identity,
    ids: agentmbx_protocol::ulid::Generator,
}

fn fx() -> Fx {
    let store = testutil::store();
    let me = Arc::new(testutil::identity("home"));
    let work = testutil::identity("work");
    store.add_peer(&work, true);
    store.register("home", &["bob"]);
    Fx {
        store,
        me,
        work,
        ids: testutil::ids(),
    }
}

impl Fx {
    /// A new envelope from work as relay wire bytes (sender key: work's pinned key).
    fn wire_item(&mut self) -> Item {
        let id = self.ids.next(T0);
        let wire = testutil::sealed_wire(
            &self.work,
            &self.me.enc_key.public(),
            &id,
            "ann@work",
            &["bob@home"],
            "s",
            T0,
        );
        Item::SealedWire {
            wire,
            item_id: id,
            sender_pubkey: self.work.host_key.public().to_b64(),
        }
    }

    /// The pinned peer `work`, as a LAN hop verifies it.
    fn hop(&self) -> peers::Peer {
        self.store
            .mailbox
            .with(|c| peers::by_name(c, "work"))
            .unwrap()
            .unwrap()
    }

    /// The same item as a LAN delivery from the hop peer `work`.
    fn lan_item(&self, item: &Item) -> Item {
        let env = agentmbx_protocol::canonical::parse(item.wire()).unwrap();
        Item::Envelope {
            env,
            hop: self.hop(),
        }
    }

    fn run(
        &self,
        granularity: Granularity,
        items: &[Item],
        after: impl FnMut(&Connection, usize, &Item, &Outcome) -> Result<(), MailboxError>,
    ) -> Result<Vec<Outcome>, MailboxError> {
        self.store
            .mailbox
            .with(|c| receive_items(c, &self.me, granularity, items, T0, after))
    }

    fn count(&self, table: &str) -> i64 {
        self.store.scalar(&format!("SELECT COUNT(*) FROM {table}"))
    }
}

/// A LAN delivery from `work` that is refused: signed by a key `work` never held.
fn forged(fx: &mut Fx) -> Item {
    let stranger = testutil::identity("work");
    let id = fx.ids.next(T0);
    let wire = testutil::sealed_wire(
        &stranger,
        &fx.me.enc_key.public(),
        &id,
        "ann@work",
        &["bob@home"],
        "s",
        T0,
    );
    Item::Envelope {
        env: agentmbx_protocol::canonical::parse(&wire).unwrap(),
        hop: fx.hop(),
    }
}

/// Writes `kv(after:<index>) = <answer>` in the item's transaction.
fn mark(conn: &Connection, i: usize, _: &Item, o: &Outcome) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO kv(k, v) VALUES (?1, ?2)",
        rusqlite::params![format!("after:{i}"), o.answer()],
    )?;
    Ok(())
}

#[test]
fn a_duplicate_queues_the_receipts_of_its_deliveries_again() {
    let mut fx = fx();
    let item = fx.wire_item();
    let out = fx
        .run(
            Granularity::PerItem,
            std::slice::from_ref(&item),
            nothing_after,
        )
        .unwrap();
    assert_eq!(
        out,
        vec![Outcome::Stored {
            delivered: vec!["bob".into()]
        }]
    );
    assert_eq!(fx.count("receipt_outbox"), 1);
    // The receipt went out; the sender asks again (over the relay, then over the LAN).
    fx.store
        .mailbox
        .with(|c| Ok(c.execute("DELETE FROM receipt_outbox", [])?))
        .unwrap();
    let out = fx
        .run(
            Granularity::PerItem,
            std::slice::from_ref(&item),
            nothing_after,
        )
        .unwrap();
    assert_eq!(out, vec![Outcome::Duplicate { requeued: 1 }]);
    assert!(out[0].wakes_senders());
    assert_eq!(fx.count("receipt_outbox"), 1);
    // Still queued unsent: nothing more is queued, and nothing to wake for.
    let lan = fx.lan_item(&item);
    let out = fx
        .run(Granularity::BatchWithSavepoints, &[lan], nothing_after)
        .unwrap();
    assert_eq!(out, vec![Outcome::Duplicate { requeued: 0 }]);
    assert!(!out[0].wakes_senders());
    assert_eq!(out[0].answer(), "duplicate");
    assert_eq!(fx.count("receipt_outbox"), 1);
    assert_eq!(fx.count("messages"), 1);
}

#[test]
fn a_refused_item_of_a_lan_batch_rolls_back_only_its_savepoint() {
    let mut fx = fx();
    let first = fx.wire_item();
    let first = fx.lan_item(&first);
    let bad = forged(&mut fx);
    let last = fx.wire_item();
    let last = fx.lan_item(&last);
    let out = fx
        .run(Granularity::BatchWithSavepoints, &[first, bad, last], mark)
        .unwrap();
    let answers: Vec<String> = out.iter().map(Outcome::answer).collect();
    assert_eq!(answers, ["accepted", "rejected:bad signature", "accepted"]);
    // Both neighbours are kept, the refused one left nothing; the caller's writes for every
    // item (outside the savepoints) committed with the batch.
    assert_eq!(fx.count("messages"), 2);
    assert_eq!(fx.count("deliveries"), 2);
    assert_eq!(fx.count("kv WHERE k LIKE 'after:%'"), 3);
    assert_eq!(
        fx.store
            .scalar::<String>("SELECT v FROM kv WHERE k = 'after:1'"),
        "rejected:bad signature"
    );
}

#[test]
fn a_fault_in_a_lan_batch_keeps_nothing_of_it() {
    let mut fx = fx();
    let items = [fx.wire_item(), fx.wire_item()];
    let err = fx
        .run(Granularity::BatchWithSavepoints, &items, |c, i, it, o| {
            mark(c, i, it, o)?;
            if i == 1 {
                return Err(MailboxError::Task);
            }
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, MailboxError::Task));
    assert_eq!(fx.count("messages"), 0);
    assert_eq!(fx.count("kv WHERE k LIKE 'after:%'"), 0);
}

#[test]
fn the_callers_after_write_commits_atomically_with_its_item() {
    let mut fx = fx();
    let items = [fx.wire_item(), fx.wire_item(), fx.wire_item()];
    // The second item's `after` fails: its item rolls back with it, the first stays
    // committed, the third is never received.
    let err = fx
        .run(Granularity::PerItem, &items, |c, i, it, o| {
            mark(c, i, it, o)?;
            if i == 1 {
                return Err(MailboxError::Task);
            }
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, MailboxError::Task));
    assert_eq!(fx.count("messages"), 1);
    assert_eq!(fx.count("kv WHERE k LIKE 'after:%'"), 1);
    let Item::SealedWire { item_id, .. } = &items[0] else {
        unreachable!()
    };
    assert_eq!(
        fx.store.scalar::<String>("SELECT id FROM messages"),
        *item_id
    );
    // A refused item is committed too, with the caller's write (its quarantine).
    let refused = Item::Unreadable {
        wire: b"%%".to_vec(),
        reason: "bad wire".into(),
    };
    let out = fx
        .run(Granularity::PerItem, &[refused], |c, _, it, o| {
            assert_eq!(it.wire(), b"%%");
            mark(c, 9, it, o)
        })
        .unwrap();
    assert_eq!(out, vec![Outcome::Refused("bad wire".into())]);
    assert_eq!(
        fx.store
            .scalar::<String>("SELECT v FROM kv WHERE k = 'after:9'"),
        "rejected:bad wire"
    );
}

#[tokio::test]
async fn the_senders_are_woken_after_the_commit_only_when_there_is_work() {
    let mut fx = fx();
    let wake = Arc::new(Notify::new());
    let inbound = Inbound::new(fx.store.mailbox.clone(), fx.me.clone(), Some(wake.clone()));
    let waits = || tokio::time::timeout(std::time::Duration::from_millis(50), wake.notified());
    // Refused: nobody woken.
    let out = inbound
        .receive(
            Granularity::BatchWithSavepoints,
            vec![forged(&mut fx)],
            T0,
            nothing_after,
        )
        .await
        .unwrap();
    assert_eq!(out, vec![Outcome::Refused("bad signature".into())]);
    assert!(waits().await.is_err());
    // Stored: the wake is raised, and the item is committed by then.
    let out = inbound
        .receive(
            Granularity::PerItem,
            vec![fx.wire_item()],
            T0,
            nothing_after,
        )
        .await
        .unwrap();
    assert!(matches!(out[0], Outcome::Stored { .. }));
    assert!(waits().await.is_ok());
    assert_eq!(fx.count("messages"), 1);
}
