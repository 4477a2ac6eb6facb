//! The request-body budget: how many bytes of request bodies a server holds at once, over all
//! connections and per caller (the relay: 64 MiB in all, 16 MiB per client address by default;
//! the LAN server: 64 MiB in all).
//!
//! # What it owns
//! A request reserves its share (its declared length, or the body cap when it declares none)
//! before its body is read — that is, before it is authenticated — and keeps it until its
//! answer is made (the [`Reservation`] is dropped). So many concurrent large uploads cannot
//! exhaust the server's memory, and with a per-key share one caller's slow uploads hold at most
//! its own share while others are still served. Two ways to reserve:
//! - [`BodyBudget::try_reserve`]: now or never, from the key's share and the whole budget
//!   together (the relay answers 503 `BUSY` at once when refused);
//! - [`BodyBudget::reserve`]: waits for room in the whole budget (the LAN server: a request
//!   waits, within its request timeout).
//!
//! # Bounds
//! Reservations are counted in [`BUDGET_UNIT`]s. The per-key reservations are kept only while
//! a reservation is held; each holds at least one unit of the whole budget, so there are never
//! more keys in that table than units in the budget (65,536 for 64 MiB).
//!
//! # What it must never do
//! Read a body, answer a request or keep anything on disk; log a key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Granularity of body-budget reservations (1 KiB).
pub const BUDGET_UNIT: u64 = 1024;

/// Units held per key, only while held (module docs, "Bounds").
type Held = Arc<Mutex<HashMap<String, u32>>>;

/// A body budget (module docs): a whole budget and, for [`BodyBudget::try_reserve`], a share
/// per key (usually a client address).
#[derive(Debug)]
pub struct BodyBudget {
    /// The whole budget, in [`BUDGET_UNIT`]s.
    budget: Arc<Semaphore>,
    /// The budget's size in units.
    budget_units: u32,
    /// Units one key may hold at once.
    per_key_units: u32,
    held: Held,
}

/// Why [`BodyBudget::try_reserve`] admitted no body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The whole budget is spent.
    Budget,
    /// The caller's key holds its share.
    Share,
}

/// A body reservation: its units of the whole budget and, when made by key, of that key's
/// share, given back when it is dropped (after the answer is made).
#[derive(Debug)]
pub struct Reservation {
    _permit: OwnedSemaphorePermit,
    /// The key's share it holds: the table, the key and the units.
    share: Option<(Held, String, u32)>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let Some((held, key, units)) = &self.share else {
            return;
        };
        let mut held = held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = held.get_mut(key) {
            *n = n.saturating_sub(*units);
            if *n == 0 {
                held.remove(key);
            }
        }
    }
}

impl BodyBudget {
    /// A budget of `budget_bytes` in all (at least one unit, at most `Semaphore::MAX_PERMITS`
    /// units) and `per_key_bytes` per key (at least one unit).
    pub fn new(budget_bytes: u64, per_key_bytes: u64) -> Self {
        let units = (budget_bytes / BUDGET_UNIT).clamp(1, Semaphore::MAX_PERMITS as u64);
        let budget_units = u32::try_from(units).unwrap_or(u32::MAX);
        let per_key_units = u32::try_from((per_key_bytes / BUDGET_UNIT).max(1)).unwrap_or(u32::MAX);
        BodyBudget {
            budget: Arc::new(Semaphore::new(budget_units as usize)),
            budget_units,
            per_key_units,
            held: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Units for `bytes`: rounded up to whole units, at least one, at most `limit`.
    fn units(bytes: u64, limit: u32) -> u32 {
        u32::try_from(bytes.div_ceil(BUDGET_UNIT).max(1))
            .unwrap_or(u32::MAX)
            .min(limit)
    }

    /// Reserves `bytes` (rounded up to whole units) for a request of `key`, from the key's
    /// share and the whole budget together, or neither.
    pub fn try_reserve(&self, key: &str, bytes: u64) -> Result<Reservation, Refusal> {
        let units = Self::units(bytes, self.budget_units.min(self.per_key_units));
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mine = held.get(key).copied().unwrap_or(0);
        if mine.saturating_add(units) > self.per_key_units {
            return Err(Refusal::Share);
        }
        let permit = self
            .budget
            .clone()
            .try_acquire_many_owned(units)
            .map_err(|_| Refusal::Budget)?;
        held.insert(key.to_owned(), mine + units);
        Ok(Reservation {
            _permit: permit,
            share: Some((self.held.clone(), key.to_owned(), units)),
        })
    }

    /// Reserves `bytes` (rounded up to whole units) of the whole budget, waiting for room;
    /// `None` only if the budget was closed (it never is while the server runs).
    pub async fn reserve(&self, bytes: u64) -> Option<Reservation> {
        let units = Self::units(bytes, self.budget_units);
        let permit = self.budget.clone().acquire_many_owned(units).await.ok()?;
        Some(Reservation {
            _permit: permit,
            share: None,
        })
    }

    /// Request-body bytes reserved right now.
    pub fn bytes_reserved(&self) -> u64 {
        let free = self.budget.available_permits() as u64;
        (u64::from(self.budget_units).saturating_sub(free)) * BUDGET_UNIT
    }

    /// Request-body bytes the requests of `key` hold right now.
    pub fn bytes_reserved_by(&self, key: &str) -> u64 {
        let held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        u64::from(held.get(key).copied().unwrap_or(0)) * BUDGET_UNIT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holding_its_body_share_leaves_the_rest_of_the_budget_to_others() {
        const MIB: u64 = 1024 * 1024;
        let limits = BodyBudget::new(40 * MIB, 16 * MIB);
        let a1 = limits.try_reserve("a", 8 * MIB).unwrap();
        let a2 = limits.try_reserve("a", 8 * MIB).unwrap();
        // At its share exactly; one byte more is refused for this address only.
        assert_eq!(limits.bytes_reserved_by("a"), 16 * MIB);
        assert_eq!(limits.try_reserve("a", 1).unwrap_err(), Refusal::Share);
        let b1 = limits.try_reserve("b", 8 * MIB).unwrap();
        let b2 = limits.try_reserve("b", 8 * MIB).unwrap();
        // 32 of 40 MiB are held: the whole budget refuses past its end, for anyone.
        let c1 = limits.try_reserve("c", 8 * MIB).unwrap();
        assert_eq!(limits.try_reserve("d", 1).unwrap_err(), Refusal::Budget);
        assert_eq!(limits.bytes_reserved(), 40 * MIB);
        // A refused reservation took nothing.
        assert_eq!(limits.bytes_reserved_by("d"), 0);
        drop(a1);
        assert_eq!(limits.bytes_reserved_by("a"), 8 * MIB);
        let a3 = limits.try_reserve("a", 8 * MIB).unwrap();
        drop((a2, a3, b1, b2, c1));
        assert_eq!(limits.bytes_reserved(), 0);
        assert!(
            limits.held.lock().unwrap().is_empty(),
            "no entry outlives its reservations"
        );
    }

    #[tokio::test]
    async fn a_waiting_reservation_gets_room_once_another_is_given_back() {
        let budget = BodyBudget::new(8 * BUDGET_UNIT, 8 * BUDGET_UNIT);
        let first = budget.reserve(8 * BUDGET_UNIT).await.unwrap();
        assert_eq!(budget.bytes_reserved(), 8 * BUDGET_UNIT);
        let waiting = budget.reserve(1);
        let mut waiting = std::pin::pin!(waiting);
        assert!(futures_poll_once(waiting.as_mut()).await.is_none());
        drop(first);
        let second = waiting.await.unwrap();
        assert_eq!(budget.bytes_reserved(), BUDGET_UNIT);
        drop(second);
        assert_eq!(budget.bytes_reserved(), 0);
    }

    /// Polls `f` once: its output if it was ready.
    async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
        let mut f = f;
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
