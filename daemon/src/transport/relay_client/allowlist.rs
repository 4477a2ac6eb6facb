//! This host's sender allowlist at the relay (spec §2; `wire.md` §2.12, §3.1, §3.5 "publish
//! sender list"): the host keys of its pinned peers, sorted, unique, at most
//! [`MAX_SENDERS`], as `POST /v2/relay/senders {list, sig}` where `list` is
//! [`SenderList`] `{v:1, type:"relay-senders", host_pubkey, senders, iat}` and `sig`
//! this host key's signature over canonical(list). The relay then refuses pushes to this host
//! from any other key (`rejected:sender not accepted by target`).
//!
//! It is published at session open whenever its digest `sha256(hostpub + ":" +
//! senders.join(","))` differs from the last one the relay accepted (kv `relay-senders:<url>`),
//! so pairing, unpairing and a peer's rotation republish it on the next pass; a fresh
//! enrolment or a new epoch drops the record, so a relay that lost it gets it again.
//!
//! 409 `STALE` (the relay holds a list with an iat at or after ours, which only this host key
//! can have signed: its clock stepped back, or a restored mailbox forgot the last publish): the
//! list is signed again once with iat = now + [`STALE_BUMP_MS`] (under the relay's 5-minute
//! future limit), which beats any list this host signed up to that much later by its clock. If
//! that is refused too, the digest stays unpublished and the next attempt waits
//! [`RETRY_AFTER_FAILURE_MS`]; later iats grow with the clock until one is newer. Any other
//! refusal also waits [`RETRY_AFTER_FAILURE_MS`] and is audited `relay.senders_failed` once per
//! digest; it never stops mail. A retry time further ahead than that minute was written under a
//! clock since set back, and is due at once ([`Published::holds_back`]). A 401 or 403 is returned to the session (this host's standing,
//! not the list's). This module never publishes a key that is not a pinned peer's.

use serde::{Deserialize, Serialize};
use serde_json::json;

use agentmbx_protocol::records::SenderList;
use agentmbx_protocol::time::iso_ms;
use agentmbx_protocol::{canonical, hash};

use super::state;
use super::{RelayClient, RelayError};
use crate::mailbox::relay_state::{kv_get, kv_set};
use crate::mailbox::{audit, peers, MailboxError};

/// Most senders in one list (`wire.md` "Resolved details": 1,024, as 0.5.x).
pub const MAX_SENDERS: usize = 1024;
/// The iat bump of the one retry after 409 `STALE` (ms): 4 minutes, under the relay's 5.
pub const STALE_BUMP_MS: i64 = 240_000;
/// Pause before publishing a refused list again (ms): 1 minute.
pub const RETRY_AFTER_FAILURE_MS: i64 = 60_000;

/// kv `relay-senders:<url>`: the last list the relay accepted, and the last refusal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Published {
    /// Digest of the accepted list (`""` before the first success).
    pub digest: String,
    /// Its iat (ms); later lists are signed with a larger one.
    pub iat: i64,
    /// How many senders it named.
    pub count: usize,
    /// Digest of the last refused list, if the last attempt failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_digest: Option<String>,
    /// No new attempt for `failed_digest` before this time (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<i64>,
}

impl Published {
    /// Whether the refusal of the list with digest `digest` still holds its next attempt back
    /// at `now_ms`: `retry_at` is ahead, but no further than [`RETRY_AFTER_FAILURE_MS`]. A time
    /// further ahead was written while the clock was ahead of the current one (a skew fixed
    /// since; spec §3 "clock"): the list is due now.
    pub fn holds_back(&self, digest: &str, now_ms: i64) -> bool {
        self.failed_digest.as_deref() == Some(digest)
            && self
                .retry_at
                .is_some_and(|t| t > now_ms && t.saturating_sub(now_ms) <= RETRY_AFTER_FAILURE_MS)
    }
}

/// The allowlist of a host: its peers' host keys, sorted (byte order, which for base64 is
/// JavaScript's default sort), unique, cut to [`MAX_SENDERS`]. Returns the list and how many
/// keys there were before the cut.
pub fn senders(peer_keys: impl IntoIterator<Item = String>) -> (Vec<String>, usize) {
    let mut all: Vec<String> = peer_keys.into_iter().collect();
    all.sort();
    all.dedup();
    let total = all.len();
    all.truncate(MAX_SENDERS);
    (all, total)
}

/// `sha256hex(host_pubkey + ":" + senders.join(","))` (`wire.md` §3.5).
pub fn digest(host_pubkey: &str, senders: &[String]) -> String {
    hash::sha256_hex(format!("{host_pubkey}:{}", senders.join(",")).as_bytes())
}

/// What [`RelayClient::publish_allowlist`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The relay already holds this list.
    Unchanged,
    /// Published now with `count` senders.
    Published {
        /// Senders in the list.
        count: usize,
    },
    /// A refused list waits for its retry time.
    Deferred,
    /// Refused now (logged; retried after [`RETRY_AFTER_FAILURE_MS`]).
    Failed,
}

fn read(conn: &rusqlite::Connection, url: &str) -> Result<Published, MailboxError> {
    Ok(kv_get(conn, &state::senders_kv(url))?
        .and_then(|v| serde_json::from_str(&v).ok())
        .unwrap_or_default())
}

fn write(conn: &rusqlite::Connection, url: &str, p: &Published) -> Result<(), MailboxError> {
    let text = serde_json::to_string(p).map_err(|e| MailboxError::Invalid(e.to_string()))?;
    kv_set(conn, &state::senders_kv(url), &text)
}

/// The allowlist record of `url`, for `relay info`. Errors: SQLite failures.
pub fn published(conn: &rusqlite::Connection, url: &str) -> Result<Published, MailboxError> {
    read(conn, url)
}

impl RelayClient {
    /// Publishes this host's allowlist when it changed (module docs). Errors: 401/403 answers
    /// ([`RelayError::is_auth`]) and storage failures; other failures are an [`Outcome`].
    pub async fn publish_allowlist(&self) -> Result<Outcome, RelayError> {
        let url = self.url.clone();
        let (keys, record) = self
            .mailbox
            .run(move |c| {
                let keys: Vec<String> = peers::list(c)?.into_iter().map(|p| p.pubkey).collect();
                Ok((keys, read(c, &url)?))
            })
            .await?;
        let me = self.ident.host_key.public().to_b64();
        let (list, total) = senders(keys);
        let d = digest(&me, &list);
        if record.digest == d {
            return Ok(Outcome::Unchanged);
        }
        let now = self.clock.now_ms();
        if record.holds_back(&d, now) {
            return Ok(Outcome::Deferred);
        }
        if total > list.len() {
            tracing::warn!(relay = %self.url, peers = total, kept = list.len(), "more peers than an allowlist holds: the relay accepts mail only from the first {MAX_SENDERS}");
        }
        let mut iat = now.max(record.iat.saturating_add(1));
        let mut answer = self.post_list(&me, &list, iat).await;
        if matches!(&answer, Err(RelayError::Status { status: 409, .. })) {
            iat = now.saturating_add(STALE_BUMP_MS).max(iat.saturating_add(1));
            tracing::warn!(relay = %self.url, "the relay holds a newer allowlist of this host (409 STALE): signing it again with a later iat");
            answer = self.post_list(&me, &list, iat).await;
        }
        let url = self.url.clone();
        match answer {
            Ok(()) => {
                let count = list.len();
                let rec = Published {
                    digest: d,
                    iat,
                    count,
                    failed_digest: None,
                    retry_at: None,
                };
                self.mailbox.run(move |c| write(c, &url, &rec)).await?;
                tracing::info!(relay = %self.url, senders = count, "published the sender allowlist");
                Ok(Outcome::Published { count })
            }
            Err(e) if e.is_auth() => Err(e),
            Err(e @ RelayError::Store(_)) => Err(e),
            Err(e) => {
                let first = record.failed_digest.as_deref() != Some(d.as_str());
                let detail = json!({"relay": url, "status": e.status(), "error": e.to_string().chars().take(300).collect::<String>()});
                let rec = Published {
                    failed_digest: Some(d),
                    retry_at: Some(now.saturating_add(RETRY_AFTER_FAILURE_MS)),
                    ..record
                };
                self.mailbox
                    .run(move |c| {
                        let tx =
                            c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                        if first {
                            audit::record(&tx, now, "relay.senders_failed", &detail)?;
                        }
                        write(&tx, &url, &rec)?;
                        tx.commit()?;
                        Ok(())
                    })
                    .await?;
                if first {
                    tracing::warn!(relay = %self.url, error = %e, "sender allowlist not published; retrying in a minute (mail still flows)");
                }
                Ok(Outcome::Failed)
            }
        }
    }

    async fn post_list(&self, me: &str, senders: &[String], iat: i64) -> Result<(), RelayError> {
        let list = SenderList {
            v: 1,
            kind: "relay-senders".into(),
            host_pubkey: me.to_string(),
            senders: senders.to_vec(),
            iat: iso_ms(iat),
        };
        let signed = canonical::of(&list).map_err(|e| RelayError::Malformed(e.to_string()))?;
        let sig = self.ident.host_key.sign(signed.as_bytes());
        let body = json!({"list": list, "sig": sig}).to_string();
        let _: serde_json::Value = self.call_json("POST", "/v2/relay/senders", &body).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    mod publish;

    #[test]
    fn senders_are_sorted_unique_and_capped() {
        let keys = ["c", "a", "b", "a"].map(String::from);
        assert_eq!(senders(keys), (vec!["a".into(), "b".into(), "c".into()], 3));
        let many: Vec<String> = (0..MAX_SENDERS + 5).map(|i| format!("k{i:05}")).collect();
        let (list, total) = senders(many.clone());
        assert_eq!((list.len(), total), (MAX_SENDERS, MAX_SENDERS + 5));
        assert_eq!(list[..], many[..MAX_SENDERS]);
        let (list, total) = senders(many[..MAX_SENDERS].to_vec());
        assert_eq!((list.len(), total), (MAX_SENDERS, MAX_SENDERS));
    }

    /// Case `clock-fix-does-not-release-mail`: a list refused while the clock was 10 min ahead
    /// is due once the clock is right; one refused at the right clock waits its minute.
    #[test]
    fn a_refused_list_put_off_under_a_clock_ahead_is_due_once_the_clock_is_right() {
        use agentmbx_protocol::clock::{Clock, ManualClock};
        const T0: i64 = 1_767_225_600_000;
        let clock = ManualClock::new(T0 + 600_000);
        let refused = |now: i64| Published {
            failed_digest: Some("d".into()),
            retry_at: Some(now + RETRY_AFTER_FAILURE_MS),
            ..Published::default()
        };
        let skewed = refused(clock.now_ms());
        assert!(skewed.holds_back("d", clock.now_ms()));
        clock.set(T0);
        assert!(!skewed.holds_back("d", clock.now_ms()));

        let right = refused(clock.now_ms());
        assert!(right.holds_back("d", clock.now_ms()));
        assert!(!right.holds_back("other", clock.now_ms()));
        clock.set(T0 + RETRY_AFTER_FAILURE_MS);
        assert!(!right.holds_back("d", clock.now_ms()));
    }

    #[test]
    fn the_digest_is_sha256_of_key_colon_joined_senders() {
        assert_eq!(
            digest("H", &["a".into(), "b".into()]),
            hash::sha256_hex(b"H:a,b")
        );
        assert_eq!(digest("H", &[]), hash::sha256_hex(b"H:"));
    }
}
