//! The one clock abstraction (design README "Decisions": time).
//!
//! Every expiry, retention, backoff, heartbeat and hop window reads time through [`Clock`].
//! Unit tests drive a [`ManualClock`]; black-box tests of real processes shift the
//! [`SystemClock`] with `MBX_CLOCK_OFFSET_MS` (read once at start), so 72 h or 14 days can be
//! crossed without sleeping. The offset is for tests and drills; it is logged when set.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// Environment variable holding a signed ms offset added to the system time.
pub const CLOCK_OFFSET_ENV: &str = "MBX_CLOCK_OFFSET_MS";

/// A source of wall-clock time in ms since the Unix epoch (UTC).
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since 1970-01-01T00:00:00Z.
    fn now_ms(&self) -> i64;
}

/// Shared handle to a clock.
pub type SharedClock = Arc<dyn Clock>;

/// The system clock plus a fixed offset in ms.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock {
    offset_ms: i64,
}

impl SystemClock {
    /// The system clock with a given offset (ms).
    pub fn with_offset(offset_ms: i64) -> Self {
        SystemClock { offset_ms }
    }

    /// The system clock shifted by `MBX_CLOCK_OFFSET_MS` when it is set to an integer.
    /// Errors: the variable is set but is not a decimal integer (returned as its text length,
    /// never silently ignored).
    pub fn from_env() -> Result<Self, ClockEnvError> {
        match std::env::var(CLOCK_OFFSET_ENV) {
            Err(_) => Ok(SystemClock::default()),
            Ok(text) => text
                .trim()
                .parse::<i64>()
                .map(SystemClock::with_offset)
                .map_err(|_| ClockEnvError(text)),
        }
    }

    /// The configured offset (ms).
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms
    }
}

/// `MBX_CLOCK_OFFSET_MS` was set to something that is not an integer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("MBX_CLOCK_OFFSET_MS must be an integer number of ms, got {0:?}")]
pub struct ClockEnvError(pub String);

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        now.saturating_add(self.offset_ms)
    }
}

/// A clock that only moves when told to (unit tests).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock standing at `ms`.
    pub fn new(ms: i64) -> Self {
        ManualClock(AtomicI64::new(ms))
    }
    /// Sets the time (ms).
    pub fn set(&self, ms: i64) {
        self.0.store(ms, Ordering::SeqCst)
    }
    /// Moves the time forward by `ms`.
    pub fn advance(&self, ms: i64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_shifts_time() {
        let base = SystemClock::default().now_ms();
        let shifted = SystemClock::with_offset(72 * 3_600_000).now_ms();
        assert!(shifted - base >= 72 * 3_600_000);
        let m = ManualClock::new(5);
        m.advance(10);
        assert_eq!(m.now_ms(), 15);
    }
}
