//! Two daemons running with one host key, as the relay sees them (a copied home, a restored
//! backup, a cloned disk): the relay side of [`agentmbx_protocol::instance`].
//!
//! Every hop that passed [`crate::auth`] (signature, enrolment, deny-list and, on an account
//! relay, the token) feeds its key and the unsigned `x-mbx-instance` header into one
//! per-process [`Instances`]; a hop without the header, or with a malformed one, never counts.
//! When two instance ids alternate on one key within
//! [`CONFLICT_WINDOW_MS`] (10 min) the relay
//! logs one WARN line (host name and key fingerprint, never the key), counts the detection in
//! `GET /v2/relay/admin/stats` (`instance_conflicts`), and tells that key in the `you` object
//! of its signed `GET /v2/relay/info` answers (`you.instance_conflict`) until the window
//! passes with one id. Advisory only: nothing else on the relay reads it, and mail goes on to
//! whichever daemon pulls it.
//!
//! Times are ms on a monotonic clock started with the relay process (`since_ms`, `last_ms` of
//! an [`InstanceConflict`]): a wall-clock change neither raises nor clears a conflict.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use axum::http::HeaderMap;
use serde::Serialize;

use agentmbx_protocol::instance::{
    InstanceConflict, InstanceTracker, Observation, CONFLICT_WINDOW_MS, INSTANCE_HEADER,
};
use agentmbx_protocol::keys::PublicKey;

/// Host keys the relay remembers instance ids for: 100,000, the default bound on live
/// enrolments (`max_live_enrolments`), so on a relay within its defaults no key seen within
/// the window is forgotten. An entry takes about 300 bytes (30 MB at the bound, only when
/// that many hosts send the header). Past it the key seen longest ago is forgotten first; a
/// forgotten key starts over, which can delay a detection but never invents one.
pub const MAX_TRACKED_KEYS: usize = 100_000;

/// The `instance_conflicts` object of `GET /v2/relay/admin/stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct InstanceStats {
    /// Detections since the relay started (one per key and episode: a key that keeps
    /// alternating counts once until its conflict clears).
    pub detected: u64,
    /// Keys whose conflict is reported now (in `you.instance_conflict`).
    pub active: u64,
}

/// The relay's one record of instance ids per host key (module docs).
#[derive(Debug)]
pub struct Instances {
    tracker: Mutex<InstanceTracker<PublicKey>>,
    started: Instant,
    detected: AtomicU64,
}

impl Default for Instances {
    /// [`MAX_TRACKED_KEYS`] keys and the 10 min window.
    fn default() -> Self {
        Self::with_window(MAX_TRACKED_KEYS, CONFLICT_WINDOW_MS)
    }
}

impl Instances {
    /// A record of at most `max_keys` keys with another window (ms); for tests.
    pub fn with_window(max_keys: usize, window_ms: i64) -> Self {
        Instances {
            tracker: Mutex::new(InstanceTracker::with_window(max_keys, window_ms)),
            started: Instant::now(),
            detected: AtomicU64::new(0),
        }
    }

    /// Now on the record's monotonic clock (ms since it was made).
    fn now_ms(&self) -> i64 {
        i64::try_from(self.started.elapsed().as_millis()).unwrap_or(i64::MAX)
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, InstanceTracker<PublicKey>> {
        self.tracker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a verified hop of `key` (enrolled as `host`) with the instance id in `headers`,
    /// if any. On a new detection: one WARN line and the count. Returns whether this hop
    /// detected a conflict.
    pub fn observe(&self, key: &PublicKey, host: &str, headers: &HeaderMap) -> bool {
        let Some(id) = headers.get(INSTANCE_HEADER).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let now = self.now_ms();
        let seen = self.tracker().observe(key, id, now);
        let Observation::Detected(c) = seen else {
            return false;
        };
        self.detected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            host = %host,
            fingerprint = %key.fingerprint(),
            instances = c.instances,
            returns = c.returns,
            window_ms = c.window_ms,
            "two daemons are using one host key (a copied home, a restored backup or a cloned disk): their hops alternate, so the host's mail is split between them; the host is told in its signed info"
        );
        true
    }

    /// The conflict reported now for `key`, if any (`you.instance_conflict`).
    pub fn conflict(&self, key: &PublicKey) -> Option<InstanceConflict> {
        let now = self.now_ms();
        self.tracker().conflict(key, now)
    }

    /// The counters of `GET /v2/relay/admin/stats`.
    pub fn stats(&self) -> InstanceStats {
        let now = self.now_ms();
        InstanceStats {
            detected: self.detected.load(Ordering::Relaxed),
            active: self.tracker().conflicts(now).len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentmbx_protocol::keys::HostKey;

    fn with(id: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(id) = id {
            h.insert(INSTANCE_HEADER, id.parse().unwrap());
        }
        h
    }

    #[test]
    fn alternation_is_counted_once_and_clears_after_the_window() {
        let rec = Instances::with_window(16, 200);
        let (k, other) = (HostKey::generate().public(), HostKey::generate().public());
        // No header, then one id: nothing.
        assert!(!rec.observe(&k, "xb", &with(None)));
        assert!(!rec.observe(&k, "xb", &with(Some("a"))));
        assert!(!rec.observe(&other, "xc", &with(Some("z"))));
        let detections: Vec<bool> = ["b", "a", "b", "a", "b", "a"]
            .iter()
            .map(|id| rec.observe(&k, "xb", &with(Some(id))))
            .collect();
        assert_eq!(detections, [false, false, false, true, false, false]);
        assert!(rec.conflict(&k).is_some());
        assert_eq!(rec.conflict(&other), None);
        assert_eq!(
            rec.stats(),
            InstanceStats {
                detected: 1,
                active: 1
            }
        );
        // One id for longer than the window: cleared, still counted once.
        std::thread::sleep(std::time::Duration::from_millis(250));
        assert!(!rec.observe(&k, "xb", &with(Some("a"))));
        assert_eq!(rec.conflict(&k), None);
        assert_eq!(
            rec.stats(),
            InstanceStats {
                detected: 1,
                active: 0
            }
        );
    }
}
