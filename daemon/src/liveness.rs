//! Liveness of the daemon's long-running loops, the second half of the service watchdog's
//! check ([`crate::service::notify::supervise`]: the store answers *and* every loop makes progress).
//!
//! A loop registers once ([`Liveness::register`], with the longest gap between two signs of
//! progress that its work can legitimately take) and gets a [`Beat`]; it stamps the beat when
//! it makes progress ([`Beat::stamp`], or [`progress`] from code running inside
//! [`Beat::scope`]) and while it idles ([`waiting`] stamps every [`Beat::idle_every`], at most
//! every [`IDLE_STAMP_MIN`], so an idle daemon has no fast timer). Dropping the last clone of the
//! beat unregisters the loop, so a loop that ended on purpose (a relay removed from the config)
//! is never reported stale. [`Liveness::stale`] lists the loops whose last stamp is older than
//! their bound.
//!
//! Stamping is one atomic store (no lock); registering and [`Liveness::stale`] take a short
//! lock. Time is the runtime's monotonic clock (`tokio::time::Instant`, so tests drive it with
//! paused time), never the wall clock. The loops use the process-wide [`global`] registry;
//! tests build their own [`Liveness`].
//!
//! The hidden variable [`MAX_GAP_ENV`] (`MBX_LIVENESS_MAX_GAP_MS`) replaces every loop's bound
//! (black-box tests use a few seconds so a hung loop shows quickly); unset or invalid, each
//! loop keeps its own. This module only observes: it must never stop, restart or slow a loop.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use tokio::time::Instant;

/// Hidden variable (ms, > 0): replaces the bound of every registered loop (tests only).
pub const MAX_GAP_ENV: &str = "MBX_LIVENESS_MAX_GAP_MS";

/// Longest pause between two stamps of an idle loop ([`waiting`]): 30 s (a loop still stamps
/// at least three times per bound, [`Beat::idle_every`]); an idle daemon wakes as rarely as it
/// can.
pub const IDLE_STAMP_MAX: Duration = Duration::from_secs(30);

/// Shortest pause between two stamps of an idle loop: no timer of an idle daemon is faster.
pub const IDLE_STAMP_MIN: Duration = Duration::from_secs(1);

/// A registry of loops and their last stamps; cheap to clone (one `Arc`).
#[derive(Debug, Clone)]
pub struct Liveness {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    epoch: Instant,
    max_gap_override: Option<Duration>,
    loops: Mutex<Vec<Weak<Slot>>>,
}

#[derive(Debug)]
struct Slot {
    name: &'static str,
    max_gap: Duration,
    epoch: Instant,
    /// Last stamp, in ms since `epoch`.
    last_ms: AtomicU64,
}

impl Slot {
    fn stamp(&self) {
        self.last_ms
            .store(ms_since(self.epoch, Instant::now()), Ordering::Relaxed);
    }

    fn gap(&self, now: Instant) -> Duration {
        let last = self.last_ms.load(Ordering::Relaxed);
        Duration::from_millis(ms_since(self.epoch, now).saturating_sub(last))
    }
}

fn ms_since(epoch: Instant, now: Instant) -> u64 {
    u64::try_from(now.saturating_duration_since(epoch).as_millis()).unwrap_or(u64::MAX)
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness::new(None)
    }
}

impl Liveness {
    /// An empty registry; `max_gap_override` replaces every loop's bound when set.
    pub fn new(max_gap_override: Option<Duration>) -> Self {
        Liveness {
            inner: Arc::new(Inner {
                epoch: Instant::now(),
                max_gap_override: max_gap_override.filter(|d| !d.is_zero()),
                loops: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Registers the loop `name` (a short word for logs and `STATUS=`, e.g. `lan delivery`),
    /// stamped now. `max_gap` is the longest legitimate time between two stamps (one pass's
    /// slowest step, network timeouts included); past it [`Self::stale`] reports the loop. The
    /// loop stays registered while any clone of the returned [`Beat`] lives.
    pub fn register(&self, name: &'static str, max_gap: Duration) -> Beat {
        let slot = Arc::new(Slot {
            name,
            max_gap: self.inner.max_gap_override.unwrap_or(max_gap),
            epoch: self.inner.epoch,
            last_ms: AtomicU64::new(0),
        });
        slot.stamp();
        let mut loops = self
            .inner
            .loops
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loops.retain(|w| w.strong_count() > 0);
        loops.push(Arc::downgrade(&slot));
        Beat { slot }
    }

    /// The registered loops whose last stamp is older than their bound, with the time since
    /// that stamp, in registration order.
    pub fn stale(&self) -> Vec<(&'static str, Duration)> {
        let now = Instant::now();
        let mut loops = self
            .inner
            .loops
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loops.retain(|w| w.strong_count() > 0);
        loops
            .iter()
            .filter_map(Weak::upgrade)
            .filter_map(|s| {
                let gap = s.gap(now);
                (gap > s.max_gap).then_some((s.name, gap))
            })
            .collect()
    }

    /// How many loops are registered now.
    pub fn registered(&self) -> usize {
        let loops = self
            .inner
            .loops
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loops.iter().filter(|w| w.strong_count() > 0).count()
    }
}

/// The process-wide registry the daemon's loops use, its bounds replaced by
/// [`MAX_GAP_ENV`] when that is set to a positive number of ms.
pub fn global() -> &'static Liveness {
    static GLOBAL: OnceLock<Liveness> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let over = std::env::var(MAX_GAP_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis);
        Liveness::new(over)
    })
}

/// One registered loop's handle: stamps its progress. Clones stamp the same loop; the loop
/// is unregistered when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Beat {
    slot: Arc<Slot>,
}

tokio::task_local! {
    static CURRENT: Beat;
}

impl Beat {
    /// Records that the loop made progress now (one atomic store).
    pub fn stamp(&self) {
        self.slot.stamp();
    }

    /// The loop's name.
    pub fn name(&self) -> &'static str {
        self.slot.name
    }

    /// The loop's bound (after [`MAX_GAP_ENV`]).
    pub fn max_gap(&self) -> Duration {
        self.slot.max_gap
    }

    /// How often an idle wait stamps ([`waiting`]): a third of the bound, kept within
    /// [`IDLE_STAMP_MIN`] ..= [`IDLE_STAMP_MAX`].
    pub fn idle_every(&self) -> Duration {
        (self.slot.max_gap / 3).clamp(IDLE_STAMP_MIN, IDLE_STAMP_MAX)
    }

    /// Runs `fut` with this beat as the task's current one, so [`progress`] and [`waiting`]
    /// inside it (on this task; see [`inherit`] for spawned ones) stamp it.
    pub async fn scope<F: Future>(self, fut: F) -> F::Output {
        CURRENT.scope(self, fut).await
    }
}

/// Stamps the current task's beat ([`Beat::scope`]); does nothing outside one.
pub fn progress() {
    let _ = CURRENT.try_with(Beat::stamp);
}

/// The current task's beat, if it runs inside [`Beat::scope`].
pub fn current() -> Option<Beat> {
    CURRENT.try_with(Beat::clone).ok()
}

/// Wraps `fut` (to be spawned) so it runs with the current task's beat, if any: its
/// [`progress`] calls stamp the loop that spawned it.
pub fn inherit<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    let beat = current();
    async move {
        match beat {
            Some(b) => b.scope(fut).await,
            None => fut.await,
        }
    }
}

/// Awaits `fut` (a loop's idle wait) and meanwhile stamps the current task's beat every
/// [`Beat::idle_every`], so a loop that waits long for work is not taken for a hung one. Outside
/// [`Beat::scope`] it is `fut.await`.
pub async fn waiting<F: Future>(fut: F) -> F::Output {
    let Some(beat) = current() else {
        return fut.await;
    };
    let every = beat.idle_every();
    let mut fut = std::pin::pin!(fut);
    loop {
        tokio::select! {
            out = &mut fut => {
                beat.stamp();
                return out;
            }
            _ = tokio::time::sleep(every) => beat.stamp(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_loop_is_stale_past_its_bound_and_fresh_after_a_stamp() {
        let live = Liveness::new(None);
        let beat = live.register("lan delivery", Duration::from_secs(60));
        assert!(live.stale().is_empty());
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(live.stale().is_empty(), "exactly the bound is not stale");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            live.stale(),
            vec![("lan delivery", Duration::from_secs(62))]
        );
        beat.stamp();
        assert!(live.stale().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_every_clone_unregisters() {
        let live = Liveness::new(None);
        let beat = live.register("relay", Duration::from_secs(1));
        let clone = beat.clone();
        assert_eq!(live.registered(), 1);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(live.stale().len(), 1);
        drop(beat);
        assert_eq!(live.stale().len(), 1, "a clone keeps it registered");
        drop(clone);
        assert!(live.stale().is_empty());
        assert_eq!(live.registered(), 0);
        // Registered again (a relay added back): fresh.
        let _again = live.register("relay", Duration::from_secs(1));
        assert!(live.stale().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_override_replaces_every_bound() {
        let live = Liveness::new(Some(Duration::from_secs(3)));
        let beat = live.register("relay", Duration::from_secs(600));
        assert_eq!(beat.max_gap(), Duration::from_secs(3));
        assert_eq!(beat.idle_every(), IDLE_STAMP_MIN);
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(live.stale().len(), 1);
        let long = Liveness::new(None).register("x", Duration::from_secs(600));
        assert_eq!(long.idle_every(), IDLE_STAMP_MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn progress_and_waiting_stamp_the_scoped_beat() {
        let live = Liveness::new(None);
        let beat = live.register("lan delivery", Duration::from_secs(30));
        let every = beat.idle_every();
        assert_eq!(every, Duration::from_secs(10));
        let l = live.clone();
        beat.scope(async move {
            // An idle wait five times the bound: never stale meanwhile.
            let checker = l.clone();
            let watch = async move {
                for _ in 0..150 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    assert!(checker.stale().is_empty(), "stale while idle");
                }
            };
            let wait = waiting(tokio::time::sleep(Duration::from_secs(150)));
            tokio::join!(watch, wait);
            // Stuck without progress: stale; progress() from a spawned, inherited task fixes it.
            tokio::time::sleep(Duration::from_secs(31)).await;
            assert_eq!(l.stale().len(), 1);
            tokio::spawn(inherit(async { progress() }))
                .await
                .expect("join");
            assert!(l.stale().is_empty());
        })
        .await;
        // Outside a scope these are no-ops.
        progress();
        assert!(current().is_none());
        assert_eq!(waiting(async { 7 }).await, 7);
    }
}
