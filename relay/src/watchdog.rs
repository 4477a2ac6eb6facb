//! The relay's service watchdog (`sd_notify(3)` `WATCHDOG=1`, `WatchdogSec=` in the shipped system
//! unit): a ping only when the store's writer thread answers a no-op request
//! ([`StoreHealth::writer_answers`](crate::store::StoreHealth::writer_answers)) in time, so the
//! manager restarts a relay whose writer, disk or runtime hangs. A relay serving reads while no
//! write can go through is not alive.
//!
//! Every tick (half the watchdog interval, at most [`MAX_TICK`]) one check runs, with a
//! deadline of one tick; a check still waiting at the next tick is waited for again, never
//! started twice (a hung writer never piles up blocked threads), and answers late are still
//! good news. A failing or late writer is logged once per change. Without `NOTIFY_SOCKET` and
//! `WATCHDOG_USEC` for this process nothing runs. This module only reads and pings: it must
//! never stop the relay or write anything to the store.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::store::RelayStore;

/// Longest pause between two checks (and pings).
pub const MAX_TICK: Duration = Duration::from_secs(5);

/// The watchdog interval the manager asked for (`WATCHDOG_USEC` for this process per
/// `WATCHDOG_PID`), if any.
pub fn interval() -> Option<Duration> {
    sd_notify::watchdog_enabled().filter(|d| !d.is_zero())
}

/// The tick for a watchdog interval: half of it, within 10 ms ..= [`MAX_TICK`].
pub fn tick_for(watchdog: Duration) -> Duration {
    (watchdog / 2).clamp(Duration::from_millis(10), MAX_TICK)
}

/// Runs for good (the caller aborts the task): every [`tick_for`]`(watchdog)` asks `store`'s
/// writer and sends `WATCHDOG=1` when it answered.
pub async fn run(store: Arc<dyn RelayStore>, watchdog: Duration) {
    let tick = tick_for(watchdog);
    tracing::info!(
        watchdog_ms = watchdog.as_millis() as u64,
        "service watchdog on: pinging every {} ms while the store's writer answers",
        tick.as_millis()
    );
    let probe = move || {
        let store = store.clone();
        async move {
            match tokio::task::spawn_blocking(move || store.writer_answers()).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err("the store check failed".to_string()),
            }
        }
    };
    run_with(tick, probe, || {
        if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]) {
            tracing::debug!(error = %e, "sd-notify message not delivered");
        }
    })
    .await
}

/// The loop of [`run`] with its parts given: every `tick` (the first at once) awaits the check
/// `probe` (spawned; one at a time) for at most one tick and calls `ping` when it answered `Ok`.
/// Never returns.
pub async fn run_with<P, F>(tick: Duration, mut probe: P, mut ping: impl FnMut())
where
    P: FnMut() -> F,
    F: Future<Output = Result<(), String>> + Send + 'static,
{
    let mut pending: Option<tokio::task::JoinHandle<Result<(), String>>> = None;
    let mut failing = false;
    let mut every = tokio::time::interval(tick);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let handle = pending.get_or_insert_with(|| tokio::spawn(probe()));
        let answer = match tokio::time::timeout(tick, &mut *handle).await {
            Ok(done) => {
                pending = None;
                done.unwrap_or_else(|_| Err("the store check failed".to_string()))
            }
            Err(_) => Err(format!(
                "the store's writer did not answer within {} ms",
                tick.as_millis()
            )),
        };
        match answer {
            Ok(()) => {
                if failing {
                    tracing::info!("watchdog: the store's writer answers again");
                }
                failing = false;
                ping();
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "watchdog: the store's writer does not answer; no watchdog ping");
                }
                failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Mutex;

    #[derive(Clone, Copy)]
    enum Answer {
        Ok,
        Fails,
        Hangs,
    }

    #[tokio::test(start_paused = true)]
    async fn pings_only_while_the_writer_answers() {
        let answer = Arc::new(Mutex::new(Answer::Ok));
        let (pings, probes) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let (a, p, q) = (answer.clone(), pings.clone(), probes.clone());
        let task = tokio::spawn(async move {
            let probe = move || {
                q.fetch_add(1, Ordering::SeqCst);
                let a = *a.lock().expect("lock");
                async move {
                    match a {
                        Answer::Ok => Ok(()),
                        Answer::Fails => Err("writer failed".to_string()),
                        Answer::Hangs => std::future::pending().await,
                    }
                }
            };
            run_with(Duration::from_secs(1), probe, move || {
                p.fetch_add(1, Ordering::SeqCst);
            })
            .await
        });
        let set = |x| *answer.lock().expect("lock") = x;
        // The test acts at half seconds, the loop ticks at whole ones.
        tokio::time::sleep(Duration::from_millis(3_500)).await;
        assert_eq!(pings.load(Ordering::SeqCst), 4, "ticks 0..=3 s");
        set(Answer::Fails);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            pings.load(Ordering::SeqCst),
            4,
            "no ping while the writer fails"
        );
        set(Answer::Hangs);
        let before = probes.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(pings.load(Ordering::SeqCst), 4, "no ping while it hangs");
        assert_eq!(
            probes.load(Ordering::SeqCst),
            before + 1,
            "a hung check is waited for, not started again"
        );
        task.abort();
        assert_eq!(tick_for(Duration::from_secs(60)), MAX_TICK);
        assert_eq!(tick_for(Duration::from_secs(2)), Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_real_store_answers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = agentmbx_protocol::keys::HostKey::generate()
            .public()
            .to_b64();
        let store: Arc<dyn RelayStore> =
            Arc::new(crate::store::SqliteStore::open(dir.path(), &key, 1_000).expect("open"));
        let pings = Arc::new(AtomicU32::new(0));
        let p = pings.clone();
        let task = tokio::spawn(run_with(
            Duration::from_millis(20),
            move || {
                let store = store.clone();
                async move {
                    tokio::task::spawn_blocking(move || store.writer_answers())
                        .await
                        .map_err(|e| e.to_string())?
                        .map_err(|e| e.to_string())
                }
            },
            move || {
                p.fetch_add(1, Ordering::SeqCst);
            },
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while pings.load(Ordering::SeqCst) < 3 {
            assert!(tokio::time::Instant::now() < deadline, "no pings");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
    }
}
