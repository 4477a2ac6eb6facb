//! The one wake point for readers that wait for mail (`GET /v1/inbox?wait=`, design issue 18
//! "Waiting").
//!
//! How it works: every write to the store goes through [`super::Mailbox::with`] (or `run`,
//! which calls it on a blocking thread). When the closure changed rows and the connection is
//! back in autocommit mode (so whatever it wrote is committed or rolled back, never pending),
//! `with` asks the deliveries table for the rows above the highest delivery `seq` it saw
//! before (`seq` is `AUTOINCREMENT` and writers are serialized by SQLite's write lock, so it
//! grows in commit order) and notifies the agents that got them, with their newest `seq`. So
//! whatever path committed the delivery — a local send (`node::send`), a LAN or relay receive
//! (`node::receive`), an alert, or a registration claiming held mail (`unclaimed::claim`) — the
//! wake fires once, after the COMMIT, and the transports know nothing of it. A rolled-back
//! write leaves no rows, so it wakes nobody.
//!
//! Waiters subscribe to their agent ([`WaitHub::subscribe`]) BEFORE they read the page they
//! may wait on, so a delivery committed between the read and the wait is never missed (a
//! `tokio::sync::watch` receiver sees every value sent after it was made). A write committed
//! by another process (a CLI run while the daemon runs) wakes its agents at the daemon's next
//! write; the daemon is the writer of deliveries in practice.
//!
//! Waiting costs no timer: a waiter sleeps on its receiver, the hub's close signal and its own
//! deadline only. The hub also bounds how many requests may wait at once
//! ([`MAX_WAITERS`]) and ends every wait at once when the daemon shuts down ([`WaitHub::close`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use rusqlite::Connection;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// Most requests that may wait for mail at once (`GET /v1/inbox?wait=`): 256. Past it a
/// request that would wait is refused (503 `TOO_MANY_WAITERS`). The local API's connection cap
/// ([`crate::api::MAX_CONNECTIONS`]) is the ordinary calls' 256 plus these and
/// [`MAX_STREAMS`], so waiters never take the connections ordinary calls need.
pub const MAX_WAITERS: usize = 256;

/// Most event streams open at once (`GET /v1/events`): 64. Past it a new stream is refused
/// (503 `TOO_MANY_WAITERS`); they have their own share of the connection cap.
pub const MAX_STREAMS: usize = 64;

/// Who waits for which agent, the bound on waiters, and the shutdown signal. Owned by the
/// [`super::Mailbox`] handle (all clones share one).
#[derive(Debug)]
pub struct WaitHub {
    /// Highest delivery `seq` already announced (read and written under the connection lock).
    seen: AtomicI64,
    /// One sender per agent someone waits for; the value is the agent's newest delivery `seq`.
    agents: Mutex<HashMap<String, watch::Sender<i64>>>,
    /// `true` once the daemon shuts down.
    closed: watch::Sender<bool>,
    /// Permits for waiting requests ([`MAX_WAITERS`]).
    slots: Arc<Semaphore>,
    /// Permits for open event streams ([`MAX_STREAMS`]).
    streams: Arc<Semaphore>,
}

impl WaitHub {
    /// A hub whose deliveries so far are those up to `seen` (the table's highest `seq`).
    pub(super) fn new(seen: i64) -> Self {
        WaitHub {
            seen: AtomicI64::new(seen),
            agents: Mutex::new(HashMap::new()),
            closed: watch::channel(false).0,
            slots: Arc::new(Semaphore::new(MAX_WAITERS)),
            streams: Arc::new(Semaphore::new(MAX_STREAMS)),
        }
    }

    /// A receiver that changes when a delivery to `agent` is committed (after this call).
    pub fn subscribe(&self, agent: &str) -> watch::Receiver<i64> {
        let mut agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        agents.retain(|_, tx| tx.receiver_count() > 0);
        agents
            .entry(agent.to_string())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// A permit to wait, or `None` when [`MAX_WAITERS`] requests wait already. Held while the
    /// request waits.
    pub fn try_wait_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }

    /// A permit to keep an event stream open, or `None` when [`MAX_STREAMS`] are open
    /// already. Held while the stream is open.
    pub fn try_stream_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.streams.clone().try_acquire_owned().ok()
    }

    /// How many event streams are open now (holding a permit of [`WaitHub::try_stream_slot`]).
    pub fn streaming(&self) -> usize {
        MAX_STREAMS - self.streams.available_permits()
    }

    /// How many requests wait now (holding a permit of [`WaitHub::try_wait_slot`]).
    pub fn waiting(&self) -> usize {
        MAX_WAITERS - self.slots.available_permits()
    }

    /// Ends every wait now and makes later ones answer at once (daemon shutdown).
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// A receiver whose value is `true` once [`WaitHub::close`] was called.
    pub fn closed(&self) -> watch::Receiver<bool> {
        self.closed.subscribe()
    }

    /// Announces the deliveries committed since the last call (see the module docs). Called
    /// by `Mailbox::with` with the connection lock held and no transaction open. A failed read
    /// is logged and retried at the next write (nothing is lost: `seen` does not move).
    pub(super) fn announce(&self, conn: &Connection) {
        let seen = self.seen.load(Ordering::SeqCst);
        let rows = conn
            .prepare_cached("SELECT agent, MAX(seq) FROM deliveries WHERE seq > ?1 GROUP BY agent")
            .and_then(|mut st| {
                st.query_map([seen], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()
            });
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read new deliveries to wake waiting readers");
                return;
            }
        };
        let Some(top) = rows.iter().map(|(_, seq)| *seq).max() else {
            return;
        };
        self.seen.store(top, Ordering::SeqCst);
        let agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        for (agent, seq) in rows {
            if let Some(tx) = agents.get(&agent) {
                tx.send_replace(seq);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::mailbox::messages;
    use crate::testutil::{self, T0};

    fn envelope(id: &str) -> serde_json::Value {
        serde_json::json!({"id": id, "ts": "2026-01-01T00:00:00.000Z", "from": "alice@home",
            "to": ["bob@home"], "thread": id, "kind": "note", "subject": "s", "body": "b"})
    }

    #[tokio::test]
    async fn a_committed_delivery_wakes_its_agent_only_after_commit_and_a_rollback_wakes_nobody() {
        let store = testutil::store();
        let mb = store.mailbox.clone();
        let mut bob = mb.waits().subscribe("bob");
        let carol = mb.waits().subscribe("carol");
        // Rolled back: nobody is woken.
        mb.with(|c| {
            let tx = c.transaction()?;
            messages::insert(&tx, &envelope("m1"), "local", T0)?;
            messages::deliver(&tx, "m1", "bob", T0)?;
            tx.rollback()?;
            Ok(())
        })
        .unwrap();
        assert!(!bob.has_changed().unwrap());
        // Inside the transaction nothing is announced yet: the closure sees no change.
        let (b2, c2) = (bob.clone(), carol.clone());
        mb.with(move |c| {
            let tx = c.transaction()?;
            messages::insert(&tx, &envelope("m2"), "local", T0)?;
            messages::deliver(&tx, "m2", "bob", T0)?;
            assert!(!b2.has_changed().unwrap() && !c2.has_changed().unwrap());
            tx.commit()?;
            Ok(())
        })
        .unwrap();
        assert!(bob.has_changed().unwrap());
        assert!(*bob.borrow_and_update() > 0);
        assert!(!carol.has_changed().unwrap());
    }
}
