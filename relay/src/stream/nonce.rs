//! The stream nonces (`docs/relay-stream.md` "Opening it"): single-use random values the relay
//! hands out in a signed `GET /v2/relay/info` (`you.stream_nonce`) and takes back, once, in the
//! signed `GET /v2/relay/stream?nonce=`, so a recorded upgrade cannot be replayed inside the
//! hop's ±300 s window.
//!
//! # What it owns
//! The table of outstanding nonces, in memory only, bounded: at most [`MAX_OUTSTANDING`] in all
//! and [`MAX_PER_KEY`] per host key (past either bound the oldest is forgotten), each usable for
//! [`NONCE_TTL_MS`] after it was issued. A relay restart forgets them all (the host asks info
//! again).
//!
//! # What it must never do
//! Log or return a nonce anywhere but to the key it was issued to, or accept one twice.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use agentmbx_protocol::stream::NONCE_TTL_MS;

/// Outstanding nonces the relay keeps at most (all keys together): 65,536.
pub const MAX_OUTSTANDING: usize = 65_536;

/// Outstanding nonces one host key may hold at most: 4.
pub const MAX_PER_KEY: usize = 4;

/// Random bytes in a nonce (sent as 22 base64url characters).
pub const NONCE_BYTES: usize = 16;

/// Why a nonce was not accepted. Every variant is answered the same (401 `BAD_NONCE`), so a
/// caller learns nothing about other keys' nonces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NonceError {
    /// Never issued, already used, or forgotten (a bound pushed it out).
    #[error("unknown or already used stream nonce")]
    Unknown,
    /// Issued more than [`NONCE_TTL_MS`] ago.
    #[error("expired stream nonce")]
    Expired,
    /// Issued to another host key (it is consumed all the same).
    #[error("stream nonce issued to another key")]
    OtherKey,
}

#[derive(Debug)]
struct Issued {
    key: String,
    at_ms: i64,
    order: u64,
}

#[derive(Debug, Default)]
struct Table {
    by_nonce: HashMap<String, Issued>,
    /// `(order, nonce)` oldest first; entries whose nonce is gone (used, or replaced) are
    /// skipped when popped.
    age: VecDeque<(u64, String)>,
    /// Per key, its outstanding nonces oldest first.
    per_key: HashMap<String, VecDeque<String>>,
    next_order: u64,
}

impl Table {
    fn forget(&mut self, nonce: &str) -> Option<Issued> {
        let issued = self.by_nonce.remove(nonce)?;
        if let Some(list) = self.per_key.get_mut(&issued.key) {
            list.retain(|n| n != nonce);
            if list.is_empty() {
                self.per_key.remove(&issued.key);
            }
        }
        Some(issued)
    }

    /// Drops `age` entries whose nonce is no longer outstanding, so the queue stays within a
    /// small multiple of the table.
    fn compact(&mut self) {
        if self.age.len() > 2 * MAX_OUTSTANDING {
            let by_nonce = &self.by_nonce;
            self.age
                .retain(|(order, n)| by_nonce.get(n).is_some_and(|i| i.order == *order));
        }
    }
}

/// The nonce table ([module docs](self)).
#[derive(Debug, Default)]
pub struct Nonces {
    table: Mutex<Table>,
}

impl Nonces {
    /// Issues a fresh nonce for `key` (a host key in canonical base64) at `now_ms`: 16 random
    /// bytes as base64url without padding. Forgets the key's oldest when it already holds
    /// [`MAX_PER_KEY`], and the relay's oldest when the table holds [`MAX_OUTSTANDING`].
    pub fn issue(&self, key: &str, now_ms: i64) -> String {
        use rand::RngCore;
        let mut raw = [0u8; NONCE_BYTES];
        rand::rngs::OsRng.fill_bytes(&mut raw);
        let nonce = agentmbx_protocol::b64::encode_url(&raw);
        let mut t = self.lock();
        while t.per_key.get(key).is_some_and(|l| l.len() >= MAX_PER_KEY) {
            let Some(oldest) = t.per_key.get(key).and_then(|l| l.front().cloned()) else {
                break;
            };
            t.forget(&oldest);
        }
        while t.by_nonce.len() >= MAX_OUTSTANDING {
            let Some((order, oldest)) = t.age.pop_front() else {
                break;
            };
            if t.by_nonce.get(&oldest).is_some_and(|i| i.order == order) {
                t.forget(&oldest);
            }
        }
        let order = t.next_order;
        t.next_order += 1;
        t.by_nonce.insert(
            nonce.clone(),
            Issued {
                key: key.to_owned(),
                at_ms: now_ms,
                order,
            },
        );
        t.age.push_back((order, nonce.clone()));
        t.per_key
            .entry(key.to_owned())
            .or_default()
            .push_back(nonce.clone());
        t.compact();
        nonce
    }

    /// Takes `nonce` back for `key` at `now_ms`. A nonce is gone after this call whatever the
    /// answer (used, expired, or presented by another key). Errors: [`NonceError`].
    pub fn consume(&self, nonce: &str, key: &str, now_ms: i64) -> Result<(), NonceError> {
        let issued = self.lock().forget(nonce).ok_or(NonceError::Unknown)?;
        if issued.key != key {
            return Err(NonceError::OtherKey);
        }
        if now_ms.saturating_sub(issued.at_ms) > NONCE_TTL_MS
            || now_ms < issued.at_ms - NONCE_TTL_MS
        {
            return Err(NonceError::Expired);
        }
        Ok(())
    }

    /// Outstanding nonces (for stats and tests).
    pub fn outstanding(&self) -> usize {
        self.lock().by_nonce.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nonce_is_single_use_bound_to_its_key_and_expires() {
        let n = Nonces::default();
        let a = n.issue("A", 1_000);
        assert_eq!(a.len(), 22);
        assert_eq!(n.consume(&a, "A", 1_000 + NONCE_TTL_MS), Ok(()));
        assert_eq!(n.consume(&a, "A", 1_001), Err(NonceError::Unknown));
        let b = n.issue("A", 1_000);
        assert_eq!(n.consume(&b, "B", 1_000), Err(NonceError::OtherKey));
        assert_eq!(n.consume(&b, "A", 1_000), Err(NonceError::Unknown));
        let c = n.issue("A", 1_000);
        assert_eq!(
            n.consume(&c, "A", 1_001 + NONCE_TTL_MS),
            Err(NonceError::Expired)
        );
        assert_eq!(n.outstanding(), 0);
    }

    #[test]
    fn the_table_keeps_four_per_key_and_forgets_the_oldest() {
        let n = Nonces::default();
        let issued: Vec<String> = (0..6).map(|_| n.issue("A", 0)).collect();
        assert_eq!(n.outstanding(), MAX_PER_KEY);
        assert_eq!(n.consume(&issued[0], "A", 0), Err(NonceError::Unknown));
        assert_eq!(n.consume(&issued[1], "A", 0), Err(NonceError::Unknown));
        assert_eq!(n.consume(&issued[5], "A", 0), Ok(()));
    }

    #[test]
    fn the_table_never_holds_more_than_its_bound() {
        let n = Nonces::default();
        let first = n.issue("k0", 0);
        for i in 1..=MAX_OUTSTANDING {
            n.issue(&format!("k{i}"), 0);
        }
        assert_eq!(n.outstanding(), MAX_OUTSTANDING);
        assert_eq!(n.consume(&first, "k0", 0), Err(NonceError::Unknown));
        assert!(n.lock().age.len() <= 2 * MAX_OUTSTANDING + 1);
    }
}
