//! A bound on repeated warnings: an event that anyone can cause (a wrong admin token, a full
//! challenge table, a peer's refused rotation records) is logged at WARN at most once per
//! interval per key (usually a client address), and otherwise at DEBUG, so a flood of requests
//! cannot flood the log.
//!
//! It owns only a bounded in-memory table of "last warned at" times. It never logs by itself,
//! never keeps anything on disk, and never grows past its cap: when the table is full of keys
//! warned within the interval, a new key is answered "not now" (DEBUG) rather than evicting
//! one, so at most `cap` WARN lines are written per interval, whatever the number of keys.

use std::collections::HashMap;
use std::sync::Mutex;

/// The usual interval between two WARN lines for one key (ms): one minute.
pub const WARN_EVERY_MS: i64 = 60_000;
/// The usual number of keys remembered at most.
pub const WARN_KEYS: usize = 1024;

/// Per-key "warn at most once per interval" (module docs). Times are ms on the caller's clock.
#[derive(Debug)]
pub struct LogGate {
    every_ms: i64,
    cap: usize,
    last: Mutex<HashMap<String, i64>>,
}

impl Default for LogGate {
    /// [`WARN_EVERY_MS`] and [`WARN_KEYS`].
    fn default() -> Self {
        LogGate::new(WARN_EVERY_MS, WARN_KEYS)
    }
}

impl LogGate {
    /// At most one WARN per `every_ms` (at least 1) per key, at most `cap` (at least 1) keys.
    pub fn new(every_ms: i64, cap: usize) -> Self {
        LogGate {
            every_ms: every_ms.max(1),
            cap: cap.max(1),
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether an event for `key` at `now_ms` should be logged at WARN: true when `key` was
    /// not warned about within the interval (and records `now_ms` as its last warning), false
    /// when it was, or when the table is full of keys warned about within the interval.
    pub fn warn(&self, key: &str, now_ms: i64) -> bool {
        // A panic while holding the lock cannot leave the map inconsistent: keep going.
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let every = self.every_ms;
        if let Some(at) = last.get(key) {
            if now_ms.saturating_sub(*at) < every {
                return false;
            }
        } else if last.len() >= self.cap {
            last.retain(|_, at| now_ms.saturating_sub(*at) < every);
            if last.len() >= self.cap {
                return false;
            }
        }
        last.insert(key.to_owned(), now_ms);
        true
    }

    /// Keys remembered now (never more than the cap).
    pub fn len(&self) -> usize {
        self.last.lock().map_or(0, |t| t.len())
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_interval_per_key_and_never_past_the_cap() {
        let g = LogGate::new(60_000, 2);
        assert!(g.warn("a", 0));
        assert!(!g.warn("a", 59_999), "within the minute");
        assert!(g.warn("a", 60_000), "a minute later");
        assert!(g.warn("b", 1));
        // Full of keys warned within the minute: a third key is not warned about, and the
        // table does not grow.
        assert!(!g.warn("c", 2));
        assert_eq!(g.len(), 2);
        // Once "b" is a minute old it makes room.
        assert!(g.warn("c", 60_001));
        assert_eq!(g.len(), 2);
        // A flood of distinct keys writes at most `cap` warnings per minute.
        let g = LogGate::new(60_000, 3);
        let warned = (0..10_000)
            .filter(|i| g.warn(&format!("10.0.{}.{}", i / 256, i % 256), 5))
            .count();
        assert_eq!((warned, g.len()), (3, 3));
    }
}
