//! The host-key challenge (spec §2, §8; `wire.md` §3.1–§3.2): the possession proof every
//! enrolment starts with, and the default enrolment authority of self-hosted relays.
//!
//! `POST /v1/relay/challenge {host, pubkey}` hands out a random challenge; `POST
//! /v1/relay/enrol` must carry the host key's signature over canonical(`{v:1, challenge, host,
//! pubkey, owner_fp}`). [`Challenges`] is that table: in memory (a restart only invalidates
//! outstanding challenges; clients retry), one pending challenge per key (a new one replaces
//! it), single use, [`CHALLENGE_TTL_MS`] lifetime, at most [`MAX_OPEN_CHALLENGES`] open — past
//! that, after dropping expired ones, a new key gets 503 BUSY — and at most
//! [`MAX_CHALLENGES_PER_ADDRESS`] open per client address (503 BUSY too). Both answers carry
//! `Retry-After`: the time until the oldest challenge in the way expires.
//!
//! A challenge is used up only by an enrolment whose signature over it verified
//! ([`Challenges::pending`] to read it, [`Challenges::consume`] once the signature checked): a
//! request with a junk signature — which anyone can send for any key — leaves the host's
//! pending challenge in place instead of burning it.
//!
//! [`HostKeyChallenge`], the authority, admits every key that proved possession:
//! `authorized_by = "host-key-challenge"`, no account.
//!
//! This module never stores anything durable and never sees private keys.

use std::collections::HashMap;

use rand::RngCore;

use super::{AuthorityError, Authorization, AuthorizeRequest, BoxFuture, EnrolmentAuthority};
use crate::store::AuthorityStrength;

/// Challenge lifetime (ms): 5 minutes.
pub const CHALLENGE_TTL_MS: i64 = 300_000;
/// Open challenges at most (memory bound).
pub const MAX_OPEN_CHALLENGES: usize = 10_000;
/// Open (unexpired) challenges one client address may hold at most (an IPv6 address counts by
/// its /64, as [`crate::ratelimit::client_address`] writes it): one address cannot fill the
/// table and lock every other host out of enrolment.
pub const MAX_CHALLENGES_PER_ADDRESS: usize = 32;

/// The `authorized_by` text of this authority.
pub const NAME: &str = "host-key-challenge";

/// An outstanding challenge for one host key.
#[derive(Debug, Clone)]
struct Pending {
    challenge: String,
    expires_ms: i64,
    /// The client address that asked for it.
    address: String,
}

/// Why [`Challenges::issue`] handed out nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChallengeError {
    /// [`MAX_OPEN_CHALLENGES`] unexpired challenges are open for other keys (503 BUSY with
    /// `Retry-After`).
    #[error("too many open enrolment challenges; retry later")]
    Busy {
        /// Until the oldest open challenge expires, ms (at least 1).
        retry_after_ms: i64,
    },
    /// The client address holds [`MAX_CHALLENGES_PER_ADDRESS`] unexpired challenges for other
    /// keys (503 BUSY with `Retry-After`).
    #[error("too many open enrolment challenges from this address; retry later")]
    AddressBusy {
        /// Until the oldest of that address's challenges expires, ms (at least 1).
        retry_after_ms: i64,
    },
    /// A thread panicked while holding the table (500).
    #[error("relay state poisoned")]
    Poisoned,
}

/// The in-memory challenge table, keyed by host key (canonical base64 text).
#[derive(Debug, Default)]
pub struct Challenges(std::sync::Mutex<HashMap<String, Pending>>);

impl Challenges {
    /// Issues a fresh random challenge (16 bytes, base64url) for `pubkey`, asked for by client
    /// `address`, valid until `now_ms +` [`CHALLENGE_TTL_MS`], replacing the key's pending one.
    /// Unless it replaces one of its own, an address holding [`MAX_CHALLENGES_PER_ADDRESS`]
    /// unexpired challenges gets [`ChallengeError::AddressBusy`]. At [`MAX_OPEN_CHALLENGES`] the
    /// expired entries are dropped first; if the table is still full and the key has none
    /// pending, [`ChallengeError::Busy`]. Both say when the oldest challenge in the way expires.
    pub fn issue(
        &self,
        pubkey: &str,
        address: &str,
        now_ms: i64,
    ) -> Result<String, ChallengeError> {
        let mut raw = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut raw);
        let challenge = agentmbx_protocol::b64::encode_url(&raw);
        let mut table = self.0.lock().map_err(|_| ChallengeError::Poisoned)?;
        let wait = |oldest: Option<i64>| oldest.map_or(1, |at| (at - now_ms).max(1));
        let renews_own = table.get(pubkey).is_some_and(|p| p.address == address);
        if !renews_own && table.len() >= MAX_CHALLENGES_PER_ADDRESS {
            let (mut held, mut oldest) = (0usize, None::<i64>);
            for p in table.values() {
                if p.address == address && p.expires_ms > now_ms {
                    held += 1;
                    oldest = Some(oldest.map_or(p.expires_ms, |o| o.min(p.expires_ms)));
                }
            }
            if held >= MAX_CHALLENGES_PER_ADDRESS {
                return Err(ChallengeError::AddressBusy {
                    retry_after_ms: wait(oldest),
                });
            }
        }
        if table.len() >= MAX_OPEN_CHALLENGES {
            table.retain(|_, p| p.expires_ms > now_ms);
        }
        if table.len() >= MAX_OPEN_CHALLENGES && !table.contains_key(pubkey) {
            let oldest = table.values().map(|p| p.expires_ms).min();
            return Err(ChallengeError::Busy {
                retry_after_ms: wait(oldest),
            });
        }
        table.insert(
            pubkey.to_owned(),
            Pending {
                challenge: challenge.clone(),
                expires_ms: now_ms + CHALLENGE_TTL_MS,
                address: address.to_owned(),
            },
        );
        Ok(challenge)
    }

    /// `pubkey`'s pending challenge, left in place; `Ok(None)` when there is none or it expired
    /// (`expires ≤ now`; an expired one is dropped).
    pub fn pending(&self, pubkey: &str, now_ms: i64) -> Result<Option<String>, ChallengeError> {
        let mut table = self.0.lock().map_err(|_| ChallengeError::Poisoned)?;
        match table.get(pubkey) {
            Some(p) if p.expires_ms > now_ms => Ok(Some(p.challenge.clone())),
            Some(_) => {
                table.remove(pubkey);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Uses up `pubkey`'s pending challenge after a signature over `challenge` verified (single
    /// use): `true` when it was still that challenge and unexpired and is now removed; `false`
    /// when another request used or replaced it meanwhile, or it expired.
    pub fn consume(
        &self,
        pubkey: &str,
        challenge: &str,
        now_ms: i64,
    ) -> Result<bool, ChallengeError> {
        let mut table = self.0.lock().map_err(|_| ChallengeError::Poisoned)?;
        match table.get(pubkey) {
            Some(p) if p.challenge == challenge && p.expires_ms > now_ms => {
                table.remove(pubkey);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// How many challenges are held (expired ones included until a full table prunes them).
    pub fn len(&self) -> usize {
        self.0.lock().map_or(0, |t| t.len())
    }

    /// Whether no challenge is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The default authority: every key that proved possession may enrol, without an account.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostKeyChallenge;

impl EnrolmentAuthority for HostKeyChallenge {
    fn name(&self) -> &'static str {
        NAME
    }

    fn strength(&self) -> AuthorityStrength {
        AuthorityStrength::HostKeyChallenge
    }

    fn authorize<'a>(
        &'a self,
        _req: &'a AuthorizeRequest,
    ) -> BoxFuture<'a, Result<Authorization, AuthorityError>> {
        Box::pin(async {
            Ok(Authorization {
                ok: true,
                account: None,
                org: None,
                reason: None,
                binding: None,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_are_single_use_and_expire() {
        let t = Challenges::default();
        let c = t.issue("k", "a", 1_000).expect("issue");
        assert_eq!(c.len(), 22, "16 bytes base64url");
        // Reading it does not use it up; consuming it does, once.
        assert_eq!(t.pending("k", 1_000).expect("pending"), Some(c.clone()));
        assert_eq!(t.pending("k", 1_000).expect("pending"), Some(c.clone()));
        assert!(t.consume("k", &c, 1_000).expect("consume"));
        assert!(!t.consume("k", &c, 1_000).expect("consume"), "single use");
        assert_eq!(t.pending("k", 1_000).expect("pending"), None);
        let c = t.issue("k", "a", 1_000).expect("issue");
        assert_eq!(
            t.pending("k", 1_000 + CHALLENGE_TTL_MS).expect("pending"),
            None,
            "expired at the TTL"
        );
        assert!(!t.consume("k", &c, 1_000).expect("consume"), "dropped");
        let c = t.issue("k", "a", 1_000).expect("issue");
        assert!(
            !t.consume("k", &c, 1_000 + CHALLENGE_TTL_MS)
                .expect("consume"),
            "expired at the TTL"
        );
        let first = t.issue("k", "a", 0).expect("issue");
        let second = t.issue("k", "a", 0).expect("issue");
        assert_ne!(first, second);
        assert_eq!(t.pending("k", 1).expect("pending"), Some(second.clone()));
        assert!(!t.consume("k", &first, 1).expect("consume"), "replaced");
        assert!(t.consume("k", &second, 1).expect("consume"));
    }

    #[test]
    fn the_table_holds_at_most_max_open_and_prunes_expired_ones() {
        let t = Challenges::default();
        // Each from its own address (one address holds at most MAX_CHALLENGES_PER_ADDRESS).
        let addr = |i: usize| format!("10.0.{}.{}", i / 256, i % 256);
        for i in 0..MAX_OPEN_CHALLENGES {
            t.issue(&format!("k{i}"), &addr(i), 0).expect("issue");
        }
        assert_eq!(t.len(), MAX_OPEN_CHALLENGES);
        assert_eq!(
            t.issue("new", "192.0.2.1", 1),
            Err(ChallengeError::Busy {
                retry_after_ms: CHALLENGE_TTL_MS - 1
            })
        );
        // A key with a pending challenge may still renew it at the bound.
        t.issue("k0", &addr(0), 2).expect("renew");
        // Once they expired, a full table makes room.
        t.issue("new", "192.0.2.1", CHALLENGE_TTL_MS + 1)
            .expect("after expiry");
        assert_eq!(t.len(), 2, "k0 (renewed at 2) and new");
    }

    #[test]
    fn one_address_holds_at_most_32_open_challenges() {
        let t = Challenges::default();
        for i in 0..MAX_CHALLENGES_PER_ADDRESS {
            // One a second: the oldest expires first.
            t.issue(&format!("k{i}"), "203.0.113.7", 1_000 * i as i64)
                .expect("under the bound");
        }
        let now = 40_000;
        assert_eq!(
            t.issue("one-more", "203.0.113.7", now),
            Err(ChallengeError::AddressBusy {
                retry_after_ms: CHALLENGE_TTL_MS - now
            }),
            "past the bound: until the oldest (issued at 0) expires"
        );
        // Renewing one of its own keys is no new challenge; other addresses are served.
        t.issue("k5", "203.0.113.7", now).expect("renew");
        t.issue("one-more", "2001:db8:1:2::/64", now)
            .expect("another address");
        // Once its oldest expired, the address may ask again.
        t.issue("one-more", "203.0.113.7", CHALLENGE_TTL_MS)
            .expect("after the oldest expired");
        assert_eq!(
            t.issue("and-another", "203.0.113.7", CHALLENGE_TTL_MS),
            Err(ChallengeError::AddressBusy {
                retry_after_ms: 1_000
            })
        );
    }

    #[tokio::test]
    async fn the_host_key_challenge_admits_without_an_account() {
        let req = AuthorizeRequest {
            host_name: "mac".into(),
            host_pubkey: "k".into(),
            owner_fp: String::new(),
            challenge: "c".into(),
            proof: None,
        };
        let a = HostKeyChallenge.authorize(&req).await.expect("answer");
        assert!(a.ok);
        assert_eq!((a.account, a.binding), (None, None));
        assert_eq!(HostKeyChallenge.name(), "host-key-challenge");
        assert_eq!(
            HostKeyChallenge.strength(),
            AuthorityStrength::HostKeyChallenge
        );
    }
}
