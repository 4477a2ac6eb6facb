use super::*;

#[test]
fn the_horizon_in_sql_is_the_horizon_in_rust() {
    let c = Connection::open_in_memory().unwrap();
    for attempts in 0..=64u32 {
        let sql: i64 = c
            .query_row(&format!("SELECT {}", horizon_sql("?1")), [attempts], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(sql, max_horizon_ms(attempts), "{attempts}");
    }
    assert_eq!(max_horizon_ms(0), 0);
    assert_eq!(max_horizon_ms(1), backoff_ms(0));
    assert_eq!(max_horizon_ms(64), BACKOFF_MAX_MS);
}

#[test]
fn backoff_doubles_and_caps() {
    assert_eq!(backoff_ms(0), 5_000);
    assert_eq!(backoff_ms(1), 10_000);
    assert_eq!(backoff_ms(9), 2_560_000);
    assert_eq!(backoff_ms(10), 3_600_000);
    assert_eq!(backoff_ms(60), 3_600_000);
}
