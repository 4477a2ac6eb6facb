//! Retry scheduling shared by the outbox and the receipt queue (`wire.md` §4 "Outbox client"):
//! the backoff of a failed attempt, how far ahead a row's `next_at` may legitimately be, the
//! "due at `:now`" and "wake at" SQL built from it, and the cut `last_error`.
//!
//! Plain functions and SQL fragments: this module owns no table, never does I/O and imports no
//! other store module (the outbox and the receipt queue both import it).

/// First retry delay (ms); the delay doubles per attempt.
pub const BACKOFF_BASE_MS: i64 = 5_000;
/// Longest retry delay (ms): one hour.
pub const BACKOFF_MAX_MS: i64 = 3_600_000;
/// Longest `last_error` kept (characters, `wire.md` §4).
pub const MAX_LAST_ERROR: usize = 300;

/// Retry delay after `attempts` failed attempts: `min(5 s · 2^attempts, 1 h)` (ms).
pub fn backoff_ms(attempts: u32) -> i64 {
    BACKOFF_BASE_MS
        .saturating_mul(1i64 << attempts.min(20))
        .min(BACKOFF_MAX_MS)
}

/// How far ahead of `now` a row's `next_at` can legitimately be after `attempts` failed
/// attempts (ms): the delay its last failure chose, [`backoff_ms`]`(attempts - 1)`; 0 before
/// any failure (a new row is due at once, and "peer is back", a re-target and a re-push make
/// a row due now). Every writer of `next_at` keeps to it. A `next_at` further ahead was
/// written while the clock was ahead of the current one (a skew fixed since): the row is due
/// now (`due_sql`), so mail queued during the skew does not wait it out.
pub fn max_horizon_ms(attempts: u32) -> i64 {
    match attempts {
        0 => 0,
        n => backoff_ms(n - 1),
    }
}

/// [`max_horizon_ms`] in SQL, over the integer column (or expression) `attempts`.
pub(crate) fn horizon_sql(attempts: &str) -> String {
    format!(
        "(CASE WHEN {attempts} <= 0 THEN 0 ELSE MIN({BACKOFF_BASE_MS} << MIN({attempts} - 1, 20), {BACKOFF_MAX_MS}) END)"
    )
}

/// The "due at `:now`" condition in SQL for a schedule column `next_at` whose furthest
/// legitimate distance ahead is the SQL expression `horizon` (ms): `next_at ≤ :now`, or
/// `next_at` further ahead than `horizon` (written by a clock that was ahead; see
/// [`max_horizon_ms`]). Written as a difference so `:now` = `i64::MAX` cannot overflow.
pub(crate) fn due_sql(next_at: &str, horizon: &str) -> String {
    format!("({next_at} <= :now OR {next_at} - :now > {horizon})")
}

/// The time (ms) the loops should wake for a schedule column `next_at` in SQL: `:now` for a
/// row [`due_sql`] finds due because it lies beyond its `horizon`, else `next_at`. Take its
/// `MIN` for a loop's next wake-up, so a loop never sleeps until a skewed time.
pub(crate) fn wake_sql(next_at: &str, horizon: &str) -> String {
    format!("(CASE WHEN {next_at} - :now > {horizon} THEN :now ELSE {next_at} END)")
}

/// `text` cut to at most [`MAX_LAST_ERROR`] characters.
pub fn cut_error(text: &str) -> String {
    text.chars().take(MAX_LAST_ERROR).collect()
}
