//! Wire timestamps (`wire.md` Decision 5, §2.1): JavaScript `Date#toISOString` exactly,
//! fixed-width `YYYY-MM-DDTHH:MM:SS.mmmZ` in UTC with milliseconds. SQL comparisons on the host
//! compare these strings, so the width never varies (years 0000–9999 only).

use ::time::OffsetDateTime;

/// Formats ms since the Unix epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ`. Out-of-range inputs are
/// clamped to the years 0000–9999.
pub fn iso_ms(ms: i64) -> String {
    const MIN: i64 = -62_167_219_200_000; // 0000-01-01T00:00:00.000Z
    const MAX: i64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    let ms = ms.clamp(MIN, MAX);
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let Ok(t) = OffsetDateTime::from_unix_timestamp(secs) else {
        return "1970-01-01T00:00:00.000Z".to_string();
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        millis
    )
}

/// Parses the exact `YYYY-MM-DDTHH:MM:SS.mmmZ` form into ms since the epoch. Anything else
/// (other widths, offsets, invalid dates) is `None`.
pub fn parse_iso_ms(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    if b.len() != 24
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
        || b[19] != b'.'
        || b[23] != b'Z'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u32> {
        let s = text.get(r)?;
        if s.bytes().all(|c| c.is_ascii_digit()) {
            s.parse().ok()
        } else {
            None
        }
    };
    let year = num(0..4)? as i32;
    let month = ::time::Month::try_from(num(5..7)? as u8).ok()?;
    let date = ::time::Date::from_calendar_date(year, month, num(8..10)? as u8).ok()?;
    let tod =
        ::time::Time::from_hms(num(11..13)? as u8, num(14..16)? as u8, num(17..19)? as u8).ok()?;
    let millis = num(20..23)? as i64;
    let secs = date.with_time(tod).assume_utc().unix_timestamp();
    Some(secs * 1000 + millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        assert_eq!(iso_ms(1_767_225_600_123), "2026-01-01T00:00:00.123Z");
        assert_eq!(iso_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            parse_iso_ms("2026-01-01T00:00:00.123Z"),
            Some(1_767_225_600_123)
        );
        assert_eq!(parse_iso_ms("2026-02-30T00:00:00.123Z"), None);
        assert_eq!(parse_iso_ms("2026-01-01T00:00:00Z"), None);
        assert_eq!(parse_iso_ms("2026-01-01T00:00:00.123+00:00"), None);
    }
}
