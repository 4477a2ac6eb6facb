//! ULID ids for envelopes (`wire.md` §2.1): 10 Crockford characters of ms time, then 16 of
//! randomness, alphabet `0123456789ABCDEFGHJKMNPQRSTVWXYZ`; within one ms the random part is
//! incremented, so ids from one generator sort in creation order.

use rand::RngCore;

const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/// True when `id` matches `^[0-9A-HJKMNP-TV-Z]{26}$` (the envelope id check).
pub fn is_valid(id: &str) -> bool {
    id.len() == 26 && id.bytes().all(|b| ALPHABET.contains(&b))
}

/// The 10-character Crockford time prefix of a ULID for `ms` (48-bit ms time).
pub fn time_prefix(ms: u64) -> String {
    let mut out = [0u8; 10];
    let mut t = ms & 0xFFFF_FFFF_FFFF;
    for slot in out.iter_mut().rev() {
        *slot = ALPHABET[(t & 31) as usize];
        t >>= 5;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A monotonic ULID generator (one per process or store).
#[derive(Debug, Default)]
pub struct Generator {
    last_ms: u64,
    last_rand: u128,
}

impl Generator {
    /// A generator with no history.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next id for time `ms` (ms since the epoch). Monotonic: never below the previous id.
    pub fn next(&mut self, ms: i64) -> String {
        let ms = ms.max(0) as u64;
        let rand80 = if ms <= self.last_ms {
            // Same (or earlier) ms: keep the last time and increment the random part.
            self.last_rand = (self.last_rand + 1) & ((1u128 << 80) - 1);
            self.last_rand
        } else {
            self.last_ms = ms;
            let mut bytes = [0u8; 16];
            rand::rngs::OsRng.fill_bytes(&mut bytes);
            self.last_rand = u128::from_be_bytes(bytes) & ((1u128 << 79) - 1);
            self.last_rand
        };
        let mut out = time_prefix(self.last_ms);
        let mut tail = [0u8; 16];
        let mut r = rand80;
        for slot in tail.iter_mut().rev() {
            *slot = ALPHABET[(r & 31) as usize];
            r >>= 5;
        }
        out.push_str(&String::from_utf8_lossy(&tail));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_and_valid() {
        let mut g = Generator::new();
        let a = g.next(1_767_225_600_123);
        let b = g.next(1_767_225_600_123);
        let c = g.next(1_767_225_600_100);
        assert!(is_valid(&a) && is_valid(&b) && is_valid(&c));
        assert!(a < b && b < c);
        assert!(!is_valid("01KDVDNB3392QN2PG1JAZXH9CI"));
    }
}
