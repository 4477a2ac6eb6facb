//! Rate-limit building blocks: the bounded table of token buckets every limiter of the
//! workspace is made of (the relay's per-address and per-sender limits, the local API's
//! per-agent classes, the LAN server's per-peer limit, its rotate route's per-address limit and
//! the pairing limits), and the generic part of the 429 answer (`Retry-After` in whole
//! seconds).
//!
//! # What it owns
//! - [`RateTable`]: GCRA buckets keyed by text, bounded to a number of keys, run on the
//!   caller's clock (ms), so tests drive them with a manual clock and a clock stepped back
//!   holds an empty bucket at most one refill interval longer, never for the size of the step.
//! - [`WhenFull`]: what a full table does with a new key — refuse it (the relay and the local
//!   API: a flood of fake keys must not reset a real caller's bucket) or forget the bucket
//!   closest to full (the LAN rotate route: a forgotten key starts with a full bucket, as it
//!   would anyway).
//! - [`retry_after_secs`] and [`too_many`]: 429 with `Retry-After` in whole seconds rounded up
//!   (at least 1), around whatever body the server answers in.
//!
//! # Bounds
//! A table holds at most its cap of keys. An entry whose bucket has refilled completely is
//! forgotten (it is the same as no entry). When a new key arrives at a full table, the refilled
//! entries are swept out; if the table is still full, [`WhenFull`] decides. A refusing table is
//! swept at most once per earliest-refill time, so a flood cannot make every request pay for a
//! sweep.
//!
//! # What it must never do
//! Know what a key means (an address, a host key, an agent name: the caller decides), keep
//! anything on disk (a restart forgets every bucket), or log a key.

use std::collections::HashMap;
use std::sync::Mutex;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// What a rate table says about one hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the bucket; the hit was counted.
    Allowed,
    /// The bucket is empty: retry after this many ms (at least 1).
    Limited {
        /// Until the next token, ms.
        retry_after_ms: i64,
    },
    /// The key is new and the table is at its cap with no refilled entry to forget: retry
    /// after this many ms (until the earliest entry refills).
    TableFull {
        /// Until the table can take a new key, ms.
        retry_after_ms: i64,
    },
}

impl Verdict {
    /// Whether the hit was allowed.
    pub fn allowed(self) -> bool {
        self == Verdict::Allowed
    }
}

/// What a full table does with a new key once its refilled buckets are swept out (module docs,
/// "Bounds").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WhenFull {
    /// Refuse the new key ([`Verdict::TableFull`], until the earliest bucket refills) rather
    /// than drop a bucket: a flood of fake keys cannot reset a real caller's bucket.
    #[default]
    Refuse,
    /// Forget the buckets closest to full until the new key fits (it is then counted as any
    /// new key): for a table where a forgotten key loses little (the LAN rotate route).
    ForgetClosestToFull,
}

/// One bounded table of token buckets, keyed by text (a client address, a sender key, a peer
/// host, or — in the host daemon's local API — an agent name).
///
/// Each bucket holds `burst` tokens (the relay's tables: `burst = per_min`) and refills
/// `per_min` per minute, continuously. It is kept as one number, the time at which the bucket
/// would be full again (GCRA's "theoretical arrival time", in µs of the caller's clock): a hit
/// is allowed while that time is at most `burst − 1` intervals ahead of now, and moves it one
/// interval on. A refused hit changes nothing.
#[derive(Debug)]
pub struct RateTable {
    /// µs between tokens (60,000,000 / per_min).
    interval_us: i64,
    /// How far ahead of now the full-again time may be and a hit still pass, µs.
    tolerance_us: i64,
    /// Keys at most.
    cap: usize,
    /// What a full table does with a new key.
    when_full: WhenFull,
    inner: Mutex<TableState>,
}

#[derive(Debug, Default)]
struct TableState {
    /// Key → the time its bucket is full again (µs).
    full_at: HashMap<String, i64>,
    /// While the table is full of unrefilled buckets: no sweep before this time (µs).
    no_sweep_before: i64,
}

impl RateTable {
    /// A table of `per_min`-token buckets holding at most `cap` keys (both at least 1).
    pub fn new(per_min: u64, cap: u64) -> Self {
        Self::with_burst(per_min, per_min, cap)
    }

    /// A table of buckets holding `burst` tokens each and refilling `per_min` tokens a minute,
    /// with at most `cap` keys (each at least 1).
    pub fn with_burst(burst: u64, per_min: u64, cap: u64) -> Self {
        let per_min = i64::try_from(per_min.max(1)).unwrap_or(i64::MAX);
        let burst = i64::try_from(burst.max(1)).unwrap_or(i64::MAX);
        let interval_us = (60_000_000 / per_min).max(1);
        RateTable {
            interval_us,
            tolerance_us: interval_us.saturating_mul(burst - 1),
            cap: usize::try_from(cap.max(1)).unwrap_or(usize::MAX),
            when_full: WhenFull::Refuse,
            inner: Mutex::new(TableState::default()),
        }
    }

    /// The same table with `policy` for a new key at a full table (default
    /// [`WhenFull::Refuse`]).
    pub fn when_full(mut self, policy: WhenFull) -> Self {
        self.when_full = policy;
        self
    }

    /// Counts one hit for `key` at `now_ms`.
    pub fn hit(&self, key: &str, now_ms: i64) -> Verdict {
        let now = now_ms.saturating_mul(1_000);
        let mut t = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let known = t.full_at.get(key).copied();
        if known.is_none() && t.full_at.len() >= self.cap {
            if now < t.no_sweep_before {
                return Verdict::TableFull {
                    retry_after_ms: ms_ceil(t.no_sweep_before - now),
                };
            }
            t.full_at.retain(|_, full| *full > now);
            if self.when_full == WhenFull::ForgetClosestToFull {
                while t.full_at.len() >= self.cap {
                    let Some(closest) = t
                        .full_at
                        .iter()
                        .min_by_key(|(_, full)| **full)
                        .map(|(k, _)| k.clone())
                    else {
                        break;
                    };
                    t.full_at.remove(&closest);
                }
            }
            if t.full_at.len() >= self.cap {
                let earliest = t.full_at.values().copied().min().unwrap_or(now + 1);
                t.no_sweep_before = earliest;
                tracing::warn!(
                    keys = t.full_at.len(),
                    "a rate table is full: new callers are refused until buckets refill"
                );
                return Verdict::TableFull {
                    retry_after_ms: ms_ceil(earliest - now),
                };
            }
        }
        // An entry that already refilled is the same as none. One further ahead than an empty
        // bucket can be (the clock was stepped back) counts as an empty bucket: a step back
        // never holds a caller up longer than one refill interval.
        let start = known.filter(|full| *full > now).map_or(now, |full| {
            full.min(now.saturating_add(self.tolerance_us + self.interval_us))
        });
        if known.is_some_and(|full| full > start) {
            // Kept, so the bucket refills from here on.
            t.full_at.insert(key.to_owned(), start);
        }
        if start - self.tolerance_us > now {
            return Verdict::Limited {
                retry_after_ms: ms_ceil(start - self.tolerance_us - now),
            };
        }
        t.full_at
            .insert(key.to_owned(), start.saturating_add(self.interval_us));
        Verdict::Allowed
    }

    /// Keys held now (refilled ones included until the next sweep).
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .full_at
            .len()
    }

    /// Whether the table holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys it holds.
    pub fn cap(&self) -> usize {
        self.cap
    }
}

/// µs → ms, rounded up, at least 1.
fn ms_ceil(us: i64) -> i64 {
    (us.max(1) + 999) / 1_000
}

/// Whole seconds of a `Retry-After` for a wait of `retry_after_ms`: rounded up, at least 1.
pub fn retry_after_secs(retry_after_ms: i64) -> u64 {
    u64::try_from(retry_after_ms.max(1))
        .unwrap_or(1)
        .div_ceil(1_000)
}

/// 429 with `Retry-After: <secs>` ([`retry_after_secs`]) around `body`, the server's own error
/// shape (the relay's `{error:"rate_limit_exceeded", code:"RATE_LIMIT", retry_after}`, the
/// LAN server's `{error}`).
pub fn too_many(retry_after_ms: i64, body: impl IntoResponse) -> Response {
    let secs = retry_after_secs(retry_after_ms);
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::RETRY_AFTER, HeaderValue::from(secs))],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests;
