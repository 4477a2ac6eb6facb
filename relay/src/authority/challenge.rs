//! The host-key challenge (spec §2, §8; `wire.md` §3.1–§3.2): the possession proof every
//! enrolment starts with, and the default enrolment authority of self-hosted relays.
//!
//! `POST /v1/relay/challenge {host, pubkey}` hands out a random challenge; `POST
//! /v1/relay/enrol` must carry the host key's signature over canonical(`{v:1, challenge, host,
//! pubkey, owner_fp}`). [`Challenges`] is that table: in memory (a restart only invalidates
//! outstanding challenges; clients retry), one pending challenge per key (a new one replaces
//! it), single use, [`CHALLENGE_TTL_MS`] lifetime, at most [`MAX_OPEN_CHALLENGES`] open — past
//! that, after dropping expired ones, a new key gets 503 BUSY.
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

/// The `authorized_by` text of this authority.
pub const NAME: &str = "host-key-challenge";

/// An outstanding challenge for one host key.
#[derive(Debug, Clone)]
struct Pending {
    challenge: String,
    expires_ms: i64,
}

/// Why [`Challenges::issue`] handed out nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChallengeError {
    /// [`MAX_OPEN_CHALLENGES`] unexpired challenges are open for other keys (503 BUSY).
    #[error("too many open enrolment challenges; retry later")]
    Busy,
    /// A thread panicked while holding the table (500).
    #[error("relay state poisoned")]
    Poisoned,
}

/// The in-memory challenge table, keyed by host key (canonical base64 text).
#[derive(Debug, Default)]
pub struct Challenges(std::sync::Mutex<HashMap<String, Pending>>);

impl Challenges {
    /// Issues a fresh random challenge (16 bytes, base64url) for `pubkey`, valid until `now_ms +`
    /// [`CHALLENGE_TTL_MS`], replacing the key's pending one. At [`MAX_OPEN_CHALLENGES`] the
    /// expired entries are dropped first; if the table is still full and the key has none
    /// pending, [`ChallengeError::Busy`].
    pub fn issue(&self, pubkey: &str, now_ms: i64) -> Result<String, ChallengeError> {
        let mut raw = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut raw);
        let challenge = agentmbx_protocol::b64::encode_url(&raw);
        let mut table = self.0.lock().map_err(|_| ChallengeError::Poisoned)?;
        if table.len() >= MAX_OPEN_CHALLENGES {
            table.retain(|_, p| p.expires_ms > now_ms);
        }
        if table.len() >= MAX_OPEN_CHALLENGES && !table.contains_key(pubkey) {
            return Err(ChallengeError::Busy);
        }
        table.insert(
            pubkey.to_owned(),
            Pending {
                challenge: challenge.clone(),
                expires_ms: now_ms + CHALLENGE_TTL_MS,
            },
        );
        Ok(challenge)
    }

    /// Takes `pubkey`'s pending challenge (single use: it is removed whether or not it is still
    /// valid); `Ok(None)` when there is none or it expired (`expires ≤ now`).
    pub fn take(&self, pubkey: &str, now_ms: i64) -> Result<Option<String>, ChallengeError> {
        Ok(self
            .0
            .lock()
            .map_err(|_| ChallengeError::Poisoned)?
            .remove(pubkey)
            .filter(|p| p.expires_ms > now_ms)
            .map(|p| p.challenge))
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
        let c = t.issue("k", 1_000).expect("issue");
        assert_eq!(c.len(), 22, "16 bytes base64url");
        assert_eq!(t.take("k", 1_000).expect("take"), Some(c));
        assert_eq!(t.take("k", 1_000).expect("take"), None, "single use");
        t.issue("k", 1_000).expect("issue");
        assert_eq!(
            t.take("k", 1_000 + CHALLENGE_TTL_MS).expect("take"),
            None,
            "expired at the TTL"
        );
        let first = t.issue("k", 0).expect("issue");
        let second = t.issue("k", 0).expect("issue");
        assert_ne!(first, second);
        assert_eq!(t.take("k", 1).expect("take"), Some(second), "replaced");
    }

    #[test]
    fn the_table_holds_at_most_max_open_and_prunes_expired_ones() {
        let t = Challenges::default();
        for i in 0..MAX_OPEN_CHALLENGES {
            t.issue(&format!("k{i}"), 0).expect("issue");
        }
        assert_eq!(t.len(), MAX_OPEN_CHALLENGES);
        assert_eq!(t.issue("new", 1), Err(ChallengeError::Busy));
        // A key with a pending challenge may still renew it at the bound.
        t.issue("k0", 2).expect("renew");
        // Once they expired, a full table makes room.
        t.issue("new", CHALLENGE_TTL_MS + 1).expect("after expiry");
        assert_eq!(t.len(), 2, "k0 (renewed at 2) and new");
    }

    #[tokio::test]
    async fn the_host_key_challenge_admits_without_an_account() {
        let req = AuthorizeRequest {
            host_name: "mac".into(),
            host_pubkey: "k".into(),
            owner_fp: String::new(),
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
