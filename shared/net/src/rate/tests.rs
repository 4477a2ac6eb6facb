//! Unit tests of the rate table and the 429 helper.

use super::*;

const MIN: i64 = 60_000;

#[test]
fn a_bucket_holds_per_min_hits_then_refills_one_interval_at_a_time() {
    let t = RateTable::new(30, 10);
    for i in 0..30 {
        assert_eq!(t.hit("a", 0), Verdict::Allowed, "hit {i}");
    }
    assert_eq!(
        t.hit("a", 0),
        Verdict::Limited {
            retry_after_ms: 2_000
        }
    );
    // Another key has its own bucket.
    assert_eq!(t.hit("b", 0), Verdict::Allowed);
    // One interval later, one more token.
    assert_eq!(t.hit("a", 1_999), Verdict::Limited { retry_after_ms: 1 });
    assert_eq!(t.hit("a", 2_000), Verdict::Allowed);
    assert!(!t.hit("a", 2_000).allowed());
    // A whole minute refills the bucket completely.
    for _ in 0..30 {
        assert!(t.hit("a", 2_000 + MIN).allowed());
    }
    assert!(!t.hit("a", 2_000 + MIN).allowed());
}

#[test]
fn a_bucket_with_its_own_burst_holds_burst_hits_and_refills_at_its_rate() {
    // 5 tokens, 120 a minute (one each 500 ms).
    let t = RateTable::with_burst(5, 120, 10);
    for i in 0..5 {
        assert_eq!(t.hit("a", 0), Verdict::Allowed, "hit {i}");
    }
    assert_eq!(
        t.hit("a", 0),
        Verdict::Limited {
            retry_after_ms: 500
        }
    );
    assert_eq!(t.hit("a", 499), Verdict::Limited { retry_after_ms: 1 });
    assert!(t.hit("a", 500).allowed());
    assert!(!t.hit("a", 500).allowed());
    // 2.5 s after the last hit the bucket is full again: 5 more, not 6.
    for _ in 0..5 {
        assert!(t.hit("a", 3_000).allowed());
    }
    assert!(!t.hit("a", 3_000).allowed());
}

#[test]
fn a_clock_stepped_back_holds_an_empty_bucket_one_interval_at_most() {
    // 5 tokens, 120 a minute (one each 500 ms), emptied at t = 1 h.
    let t = RateTable::with_burst(5, 120, 10);
    let hour = 3_600_000;
    for _ in 0..5 {
        assert!(t.hit("a", hour).allowed());
    }
    // The clock steps back an hour: an empty bucket, not one full an hour from now.
    assert_eq!(
        t.hit("a", 0),
        Verdict::Limited {
            retry_after_ms: 500
        }
    );
    assert!(t.hit("a", 500).allowed());
    assert!(!t.hit("a", 500).allowed());
}

#[test]
fn a_full_table_sweeps_refilled_buckets_and_otherwise_refuses_new_keys() {
    let t = RateTable::new(60, 3); // one token per second
    for k in ["a", "b", "c"] {
        assert!(t.hit(k, 0).allowed());
    }
    // Full of buckets that have not refilled: a new key is refused, known keys go on.
    assert_eq!(
        t.hit("d", 500),
        Verdict::TableFull {
            retry_after_ms: 500
        }
    );
    assert_eq!(t.len(), 3);
    assert!(t.hit("a", 500).allowed());
    // No sweep before the earliest refill, even for other new keys.
    assert!(matches!(t.hit("e", 900), Verdict::TableFull { .. }));
    // "b" and "c" refilled at 1,000 ("a" took a second hit): they are swept, "d" gets in.
    assert!(t.hit("d", 1_000).allowed());
    assert_eq!(t.len(), 2);
    assert!(t.len() <= t.cap());
}

#[test]
fn sixty_thousand_distinct_keys_never_grow_a_table_past_its_cap() {
    let t = RateTable::new(30, 50_000);
    let mut refused = 0;
    for i in 0..60_000u32 {
        let key = std::net::Ipv4Addr::from(0x0A00_0000 + i).to_string();
        if !t.hit(&key, 0).allowed() {
            refused += 1;
        }
    }
    assert_eq!((t.len(), refused), (50_000, 10_000));
    // Once their buckets refilled, new keys are admitted again.
    assert!(t.hit("fresh", 2_000).allowed());
    assert_eq!(t.len(), 1);
}

#[test]
fn a_full_table_that_forgets_makes_room_by_the_buckets_closest_to_full() {
    let t = RateTable::new(60, 3).when_full(WhenFull::ForgetClosestToFull); // one token per second
    assert!(t.hit("a", 0).allowed());
    assert!(t.hit("b", 100).allowed());
    assert!(t.hit("c", 200).allowed());
    // Full of buckets that have not refilled: "a" is the closest to full, and goes.
    assert!(t.hit("d", 300).allowed());
    assert_eq!(t.len(), 3);
    assert!(
        t.hit("a", 300).allowed(),
        "a forgotten key starts with a full bucket"
    );
    // A flood of new keys never grows the table.
    for i in 0..1_000 {
        assert!(t.hit(&format!("k{i}"), 400).allowed());
        assert!(t.len() <= t.cap());
    }
}

#[test]
fn retry_after_is_whole_seconds_at_least_one() {
    for (ms, secs) in [
        (1, "1"),
        (999, "1"),
        (1_000, "1"),
        (1_001, "2"),
        (59_000, "59"),
    ] {
        let r = too_many(ms, ());
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], secs, "{ms}");
    }
    assert_eq!(retry_after_secs(0), 1);
    assert_eq!(retry_after_secs(-5), 1);
}
