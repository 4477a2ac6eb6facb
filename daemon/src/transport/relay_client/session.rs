//! Opening a relay session each pass (spec §1, §8; `wire.md` §3.5 "Session open"): signed
//! `GET /v2/relay/info`, the pinned-key check, the epoch, enrolment, this host's v2 enc-key ad
//! and its sender allowlist ([`super::allowlist`]).
//!
//! It also owns what a new epoch or a rewind does, wherever it is seen (info here, a push
//! accept in [`super::push`], a pull page, a 409 or a BAD_ACK in [`super::pull`]):
//! [`RelayClient::epoch_changed`] moves the relay's accepted rows to `repush` and restarts the
//! receive position at 0 in one transaction (spec §5 "On seeing a new epoch").
//!
//! Enrolment is what the relay's signed info says (`you`), never a permanent local flag (G6):
//! the cache `relay-enrolled:<url>` ([`state::Enrolment`]) only counts for the same relay key,
//! epoch and host key. A missing `you`, a cache from another epoch, relay key or host key, or a
//! 401 on a signed request runs challenge, enrol and enc-ad publish again in the same pass. A
//! refusal right after a fresh enrolment (no `you`, or a 401) backs off 1 min doubling to 1 h
//! and is classified from the relay's `Date` header as `clock-skew` or `refused-after-enrol`;
//! a 403 `REVOKED` is the `revoked` state (for good) and a 403 `DENIED` (or a 403 with no known
//! code) the `denied` state (until the operator lifts it), both with the same backoff. A 503
//! `AUTHORITY_UNAVAILABLE` at enrolment (the relay's enrolment authority cannot decide now) is
//! no denial: it is recorded as `enrol-failed` with that reason and the loop waits the
//! `retry_after` the relay gave. Every verdict is written to the relay state ([`state`]) and
//! the trust events are audited (`relay.enrolled`, `relay.enrolment_lost`,
//! `relay.enrol_failed`, `relay.key_changed`). The warning that the relay lost this host's
//! enrolment is logged when the relay answered 401 `NOT_ENROLLED`, or once a re-enrolment for
//! another reason succeeded; never before a 403 refusal.
//!
//! On a relay run with the account authority the token goes only to a relay that presented the
//! pinned key in this pass: [`RelayClient::open_session`] forgets the last pass's confirmation,
//! so the first signed info of a pass carries no token, and [`RelayClient::confirm_relay_key`]
//! is called only once the served key equals the pinned one (the relay answers that info with
//! `you` all the same; the later requests carry the token).
//!
//! Each session also hands the relay's `you.instance_conflict` (two daemons alternating on this
//! host key, as the relay sees them) to the daemon's [`crate::instance::Instance`], which logs
//! a new detection once and reports it in `/v1/health` and `doctor`.
//!
//! The v2 enc-key ad (`wire.md` §2.8) is valid 30 days and republished when the relay's copy is
//! missing, v1-only, names another key or is older than a day, once a day, when this host's
//! keys change and in a new epoch. This module never sends a request to a relay whose key is
//! not the pinned one after the info that revealed it, and never logs keys or signatures.

use serde_json::json;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::records::{self, EncAd, ENC_AD_TTL_MS, FUTURE_SKEW_MS};
use agentmbx_protocol::time::{iso_ms, parse_iso_ms};
use agentmbx_protocol::wire::{ChallengeResponse, EncKeyAnswer, Limits, RelayInfo, YouEncAd};

use super::state::{self, Enrolment, PublishedAd, RelayState, Standing};
use super::{status_error, RelayClient, RelayError};
use crate::mailbox::audit;
use crate::mailbox::outbox::{self, Repush};
use crate::mailbox::relay_state::{self, kv_get, kv_set};

/// This host republishes its enc-key ad once a day (ms; `wire.md` §2.8 "refresh daily").
pub const ENC_AD_REFRESH_MS: i64 = 86_400_000;
/// After a publish, a relay copy that still looks wrong is published again no sooner than this
/// (ms), so a relay that does not keep the ad cannot turn every pass into a publish.
pub const ENC_AD_DRIFT_RETRY_MS: i64 = 60_000;

/// Why a session enrols again after the relay answered 401 `NOT_ENROLLED` to a signed request
/// (the only reason that is announced as a lost enrolment before the attempt).
const NOT_ENROLLED_401: &str = "the relay answered 401 (not enrolled) to a signed request";

/// What a session learned from the relay.
#[derive(Debug, Clone)]
pub struct Session {
    /// Current epoch.
    pub epoch: String,
    /// Published limits.
    pub limits: Limits,
    /// The relay's view of this host's queue head.
    pub head_seq: i64,
    /// The single-use nonce for opening the push stream (`you.stream_nonce`,
    /// `docs/relay-stream.md`); `None` from a relay that does not offer the stream.
    pub stream_nonce: Option<String>,
}

/// How the enc-key ad step of a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdOutcome {
    /// The relay holds a current ad of this host, expiring at `exp` (ms).
    Current {
        /// Expiry (ms).
        exp: i64,
    },
    /// A new ad was published now, expiring at `exp` (ms).
    Published {
        /// Expiry (ms).
        exp: i64,
    },
    /// Publishing failed (receiving still works; peers cannot seal new mail for this host).
    Failed {
        /// HTTP status, if the relay answered.
        status: Option<u16>,
        /// What went wrong.
        detail: String,
    },
}

/// True when `you` in signed info is this host key under this host's name.
fn is_me(info: &RelayInfo, me: &str, name: &str) -> bool {
    info.you
        .as_ref()
        .is_some_and(|y| y.pubkey == me && y.host == name)
}

/// True when the relay's copy of this host's ad is a current v2 ad for `enc_pub` issued less
/// than a day ago (judged from its expiry: every ad of ours lives [`ENC_AD_TTL_MS`]).
pub fn relay_copy_is_fresh(served: Option<&YouEncAd>, enc_pub: &str, now_ms: i64) -> bool {
    served.is_some_and(|a| {
        !a.v1
            && a.enc_pub == enc_pub
            && parse_iso_ms(&a.exp).is_some_and(|exp| {
                let left = exp - now_ms;
                left > ENC_AD_TTL_MS - ENC_AD_REFRESH_MS && left <= ENC_AD_TTL_MS + FUTURE_SKEW_MS
            })
    })
}

/// Why this host's ad must be published now, or `None` when the relay's copy is current
/// (`wire.md` §2.8, §3.5 "ensure enc ad"). `published` is what this host last published there.
pub fn ad_due(
    published: Option<&PublishedAd>,
    served: Option<&YouEncAd>,
    host_pubkey: &str,
    enc_pub: &str,
    epoch: &str,
    now_ms: i64,
) -> Option<&'static str> {
    let fresh = relay_copy_is_fresh(served, enc_pub, now_ms);
    match published {
        None if fresh => None,
        None => Some("the relay holds no current ad of this host"),
        Some(p) if p.host_pubkey != host_pubkey || p.enc_pub != enc_pub => {
            Some("this host's keys changed")
        }
        Some(p) if p.epoch != epoch => Some("new relay epoch"),
        // The next refresh (`iat` + a day) is further ahead than its rule allows: the ad was
        // published while the clock was ahead of the current one (a skew fixed since), so
        // peers may refuse its `iat` as not yet valid, and no retry would come before the
        // clock caught up.
        Some(p) if p.iat > now_ms => Some("published while the clock was ahead"),
        Some(p) if now_ms - p.iat >= ENC_AD_REFRESH_MS => Some("daily refresh"),
        Some(p) if !fresh && now_ms - p.iat >= ENC_AD_DRIFT_RETRY_MS => {
            Some("the relay's copy is missing, v1-only, stale or names another key")
        }
        Some(_) => None,
    }
}

/// The verdict on a relay's enc-key answer for a peer (`wire.md` §2.8): the signed v2 ad when it
/// is valid for `peer_pubkey` (the peer's pinned host key) at `now_ms` and the served key is the
/// advertised one, else the refusal reason (`unsigned`, `malformed`, `wrong peer`, `bad
/// signature`, `not yet valid`, `expired`, `lifetime over the maximum`, `tampered: …`,
/// `unexpiring v1 advertisement (…)`).
pub fn enc_ad_from_answer(
    answer: &EncKeyAnswer,
    peer_pubkey: &str,
    now_ms: i64,
) -> Result<EncAd, String> {
    let Some(ad) = answer.ad.as_ref() else {
        return Err(if answer.sig.as_deref().is_some_and(|s| !s.is_empty()) {
            "unexpiring v1 advertisement (the peer's AgentMBX predates signed expiring ads, or the relay withheld the current one)".to_string()
        } else {
            "unsigned".to_string()
        });
    };
    let ad = records::verify_enc_ad(ad, answer.ad_sig.as_deref(), peer_pubkey, now_ms)
        .map_err(str::to_string)?;
    if answer.enc_pub != ad.enc_pub {
        return Err("tampered: the served key differs from the signed advertisement".into());
    }
    Ok(ad)
}

impl RelayClient {
    /// Opens a session: info, key check, epoch, enrolment, enc-key ad and allowlist as needed.
    /// Errors: [`RelayError`]; [`RelayError::KeyMismatch`] means relay use must stop until the
    /// owner confirms; [`RelayError::Refused`] that no enrolment is tried before its time.
    pub async fn open_session(&self) -> Result<Session, RelayError> {
        // A new pass: no account token until this pass's signed info showed the pinned key.
        self.unconfirm_relay_key();
        self.announce_rotations().await?;
        self.session_with(None).await
    }

    /// Opens a session after the relay answered 401 to a signed request of this pass (spec §8):
    /// the enrolment cache is dropped and challenge, enrol and enc-ad publish run again now.
    /// Errors: as [`Self::open_session`].
    pub async fn recover_enrolment(&self) -> Result<Session, RelayError> {
        self.session_with(Some(NOT_ENROLLED_401)).await
    }

    async fn signed_info(&self) -> Result<RelayInfo, RelayError> {
        match self
            .call_json::<RelayInfo>("GET", "/v2/relay/info", "")
            .await
        {
            Ok(info) => Ok(info),
            Err(e) => {
                let status = match &e {
                    RelayError::Status { status, .. } => Some(*status),
                    _ => None,
                };
                if matches!(e, RelayError::Unreachable(_)) || status.is_some_and(|s| s >= 500) {
                    let mut st = RelayState::new(Standing::Unreachable);
                    st.detail = Some(unreachable_detail(&e));
                    st.status = status;
                    self.note(st, false).await?;
                }
                Err(e)
            }
        }
    }

    /// A fresh single-use stream nonce (`you.stream_nonce`) from a new signed info whose key
    /// is checked against the pin, for a stream whose pass's nonce was refused (401
    /// `BAD_NONCE`: it expired while the pass pushed and pulled). `None`: the relay gave none.
    /// Errors: as [`Self::open_session`].
    pub async fn fresh_stream_nonce(&self) -> Result<Option<String>, RelayError> {
        let info = self.signed_info().await?;
        self.check_relay_key(&info).await?;
        Ok(info.you.and_then(|y| y.stream_nonce))
    }

    async fn session_with(&self, force: Option<&'static str>) -> Result<Session, RelayError> {
        let mut info = self.signed_info().await?;
        self.check_relay_key(&info).await?;
        self.note_epoch(&info.epoch).await?;
        let mut fresh = false;
        let why = match force {
            Some(why) => Some(why),
            None => self.enrolment_verdict(&info).await?,
        };
        if let Some(why) = why {
            info = self.enrol_and_confirm(&info, why).await?;
            fresh = true;
        }
        let ad = match self.publish_owned(&info, fresh).await {
            Err(e) if e.is_not_enrolled() && !fresh => {
                info = self.enrol_and_confirm(&info, NOT_ENROLLED_401).await?;
                self.publish_owned(&info, true).await
            }
            other => other,
        };
        let ad = match ad {
            Ok(ad) => ad,
            Err(e) if e.is_not_enrolled() => {
                return Err(self.refused_after_enrol(&info.epoch).await?)
            }
            Err(e) if e.is_auth() => return Err(self.refused_by_relay(&e, &info.epoch).await?),
            Err(e) => return Err(e),
        };
        // A refusal episode (`relay-enrol-backoff`) is not over here even after a fresh
        // enrolment's ad was accepted: a 401 later in this pass is still a refusal right after
        // that enrolment, and its pause must double. Only a whole successful pass ends it
        // (`super::pass`).
        let mut st = RelayState::new(Standing::Ok);
        st.relay_fp = Some(self.relay_key.fingerprint());
        st.epoch = Some(info.epoch.clone());
        match &ad {
            AdOutcome::Current { exp } | AdOutcome::Published { exp } => {
                st.enc_ad_exp = Some(iso_ms(*exp));
            }
            AdOutcome::Failed { status, detail } => {
                st.state = Standing::EncAdFailed;
                st.status = *status;
                st.detail = Some(detail.clone());
            }
        }
        if self.note(st, true).await? {
            match &ad {
                AdOutcome::Failed { detail, .. } => {
                    tracing::warn!(relay = %self.url, error = %detail, "enc-key ad not published; peers cannot seal new mail for this host until it is");
                }
                _ => tracing::info!(relay = %self.url, epoch = %info.epoch, "relay session open"),
            }
        }
        // Two daemons on this host key, as the relay sees them (advisory; crate::instance).
        if let (Some(instance), Some(you)) = (&self.instance, &info.you) {
            instance.note_relay(&self.url, you.instance_conflict.clone());
        }
        let (head_seq, stream_nonce) = info.you.map_or((0, None), |y| (y.head_seq, y.stream_nonce));
        Ok(Session {
            epoch: info.epoch,
            limits: info.limits,
            head_seq,
            stream_nonce,
        })
    }

    /// Ends a refusal episode (`relay-enrol-backoff:<url>`) once a whole pass of signed requests
    /// was accepted ([`super::pass`]); an accepted request inside a pass that is refused later
    /// does not end it. Errors: storage failures.
    pub async fn end_backoff(&self) -> Result<(), RelayError> {
        let url = self.url.clone();
        self.mailbox
            .run(move |c| {
                if state::backoff(c, &url)?.is_some() {
                    state::clear_backoff(c, &url)?;
                }
                Ok(())
            })
            .await?;
        Ok(())
    }

    /// Writes the relay state (`key-mismatch` survives everything but `ok` from a matching
    /// key, which `replace` allows). Returns true when the verdict changed.
    pub(super) async fn note(&self, st: RelayState, replace: bool) -> Result<bool, RelayError> {
        let (url, now) = (self.url.clone(), self.clock.now_ms());
        Ok(self
            .mailbox
            .run(move |c| {
                if replace {
                    state::set_state(c, &url, st, now)
                } else {
                    state::note_state(c, &url, st, now)
                }
            })
            .await?)
    }

    /// The pin check (spec §1): a served key other than the pinned one records `key-mismatch`
    /// (audited once per served key) and ends the session before any other request.
    async fn check_relay_key(&self, info: &RelayInfo) -> Result<(), RelayError> {
        if info.relay_pubkey == self.relay_key.to_b64() {
            self.confirm_relay_key();
            return Ok(());
        }
        self.unconfirm_relay_key();
        let served = PublicKey::from_b64(&info.relay_pubkey)
            .map(|k| k.fingerprint())
            .unwrap_or_else(|_| "unparseable".into());
        let pinned = self.relay_key.fingerprint();
        let (url, now, p, s) = (
            self.url.clone(),
            self.clock.now_ms(),
            pinned.clone(),
            served.clone(),
        );
        let new = self
            .mailbox
            .run(move |c| state::record_key_mismatch(c, &url, "pinned", &p, &s, now))
            .await?;
        if new {
            tracing::error!(relay = %self.url, pinned = %pinned, served = %served,
                "relay key changed: relay use stopped (no push, pull or enrolment); if the operator rotated the key, confirm with `agentmbx relay set {} --key {served}`", self.url);
        }
        Err(RelayError::KeyMismatch { pinned, served })
    }

    /// Reads the pin again (`relay set --key` may have confirmed another key while the daemon
    /// runs) and uses it from now on (spec §1). A stored pin replaces the one in memory. With no
    /// stored pin but an expected fingerprint (`relay set --key <fp>` while the relay was
    /// unreachable, kv `relay-key-expect:<url>`), the key in memory is trusted no longer, even
    /// when its fingerprint is the expected one: the relay's served key is fetched and pinned
    /// only when it has that fingerprint ([`super::pin::resolve_key`]), and until then no pass
    /// runs. Errors: [`RelayError::KeyMismatch`] (the relay serves another key than the expected
    /// one: recorded and audited once per served key), [`RelayError::Unreachable`] and other
    /// network errors (the expected key could not be checked yet; the relay state says
    /// `unreachable`), storage failures.
    pub async fn reload_pin(&mut self) -> Result<(), RelayError> {
        let (k, e) = (state::key_kv(&self.url), state::expect_kv(&self.url));
        let (stored, expected) = self
            .mailbox
            .run(move |c| Ok((kv_get(c, &k)?, kv_get(c, &e)?)))
            .await?;
        if let Some(key) = stored.and_then(|s| PublicKey::from_b64(&s).ok()) {
            if key != self.relay_key {
                tracing::warn!(relay = %self.url, from = %self.relay_key.fingerprint(), to = %key.fingerprint(), "the owner confirmed another relay key; using it");
                self.relay_key = key;
            }
            return Ok(());
        }
        let Some(fp) = expected else {
            return Ok(());
        };
        if self.relay_key.fingerprint() != fp {
            tracing::debug!(relay = %self.url, dropped = %self.relay_key.fingerprint(), expected = %fp, "the owner named another relay key: the one in use is no longer trusted");
        }
        match super::pin::resolve_key(&self.url, None, &self.mailbox, &self.clock).await {
            Ok(key) => {
                if key != self.relay_key {
                    tracing::warn!(relay = %self.url, from = %self.relay_key.fingerprint(), to = %key.fingerprint(), "pinned the relay key the owner named; using it");
                }
                self.relay_key = key;
                Ok(())
            }
            Err(e) => {
                let status = e.status();
                if matches!(e, RelayError::Unreachable(_)) || status.is_some_and(|s| s >= 500) {
                    let mut st = RelayState::new(Standing::Unreachable);
                    st.detail = Some(unreachable_detail(&e));
                    st.status = status;
                    self.note(st, false).await?;
                }
                Err(e)
            }
        }
    }

    /// Records the relay epoch its signed info shows (spec §5): the first one is only recorded;
    /// another than the recorded one is a new epoch ([`Self::epoch_changed`]).
    async fn note_epoch(&self, epoch: &str) -> Result<(), RelayError> {
        self.epoch_changed(epoch, Repush::Epoch, "another epoch in the relay's info")
            .await?;
        Ok(())
    }

    /// The epoch this host last recorded for this relay (kv `relay-epoch:<url>`), else
    /// `fallback`. Errors: storage failures.
    pub async fn current_epoch(&self, fallback: &str) -> Result<String, RelayError> {
        let key = state::epoch_kv(&self.url);
        let stored = self.mailbox.run(move |c| kv_get(c, &key)).await?;
        Ok(stored.unwrap_or_else(|| fallback.to_string()))
    }

    /// The relay showed epoch `epoch` (in its info, a push accept, a pull page or a 409), or
    /// went back in time within it (`why` [`Repush::Rewind`]: `head_seq` below
    /// `received_through`, or BAD_ACK); `reason` says where, for the log and the audit (spec
    /// §5 "On seeing a new epoch"; `wire.md` §3.5 "Epoch change / rewind"). A new epoch (one
    /// other than the recorded one, kv `relay-epoch:<url>` or else the receive position's) and
    /// every rewind are handled in ONE transaction: the relay's accepted rows without a delivery
    /// receipt become `repush` ([`outbox::repush_for_epoch`]: due now, same wire bytes, accept
    /// time and deadline kept), the receive position restarts at 0 in `epoch` with nothing
    /// acked, the epoch is recorded, and `relay.epoch_changed` is audited. The first epoch ever
    /// seen, or the recorded one again, is only recorded (a receive position of another epoch is
    /// restarted at 0). Returns how many rows became `repush`, or `None` when it was no change.
    /// Errors: storage failures.
    pub async fn epoch_changed(
        &self,
        epoch: &str,
        why: Repush,
        reason: &'static str,
    ) -> Result<Option<usize>, RelayError> {
        let (url, ep, now) = (self.url.clone(), epoch.to_string(), self.clock.now_ms());
        let done = self
            .mailbox
            .run(move |c| {
                let key = state::epoch_kv(&url);
                let pos = relay_state::position(c, &url)?;
                // The steady state (same epoch everywhere) reads only.
                if why == Repush::Epoch
                    && kv_get(c, &key)?.as_deref() == Some(ep.as_str())
                    && pos.as_ref().is_some_and(|p| p.epoch == ep)
                {
                    return Ok(None);
                }
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let old = kv_get(&tx, &key)?;
                let pos = relay_state::position(&tx, &url)?;
                let known = old
                    .clone()
                    .or_else(|| pos.as_ref().map(|p| p.epoch.clone()));
                let change = match why {
                    Repush::Rewind => true,
                    Repush::Epoch => known.as_deref().is_some_and(|k| k != ep),
                };
                let mut moved = None;
                if change {
                    let n = outbox::repush_for_epoch(&tx, &url, &ep, why, now)?;
                    relay_state::reset(&tx, &url, &ep, now)?;
                    audit::record(
                        &tx,
                        now,
                        "relay.epoch_changed",
                        &json!({"relay": url, "from": known, "to": ep, "why": why.as_str(),
                                "reason": reason, "repush": n}),
                    )?;
                    moved = Some((known, n));
                } else if pos.as_ref().is_none_or(|p| p.epoch != ep) {
                    relay_state::reset(&tx, &url, &ep, now)?;
                }
                if old.as_deref() != Some(ep.as_str()) {
                    kv_set(&tx, &key, &ep)?;
                }
                tx.commit()?;
                Ok(moved)
            })
            .await?;
        Ok(done.map(|(from, rows)| {
            tracing::warn!(relay = %self.url, from = from.as_deref().unwrap_or(""), to = epoch,
                why = why.as_str(), reason, rows,
                "the relay's epoch changed or it went back in time: pushing relay-accepted mail again and pulling everything again");
            rows
        }))
    }

    /// Whether this host must enrol now, and why: `you` missing or naming another host name, or
    /// a cached enrolment for another epoch, relay key or host key (spec §8). A confirmed
    /// enrolment refreshes the cache (a backoff episode ends only once signed requests are
    /// accepted again: [`Self::end_backoff`]). Errors: storage failures.
    async fn enrolment_verdict(
        &self,
        info: &RelayInfo,
    ) -> Result<Option<&'static str>, RelayError> {
        let me = self.ident.host_key.public().to_b64();
        if !is_me(info, &me, self.ident.host.as_str()) {
            return Ok(Some(match &info.you {
                Some(y) if y.pubkey == me => "the relay knows this host key under another name",
                _ => "the relay's signed info does not know this host key",
            }));
        }
        let (url, now, relay_key, epoch) = (
            self.url.clone(),
            self.clock.now_ms(),
            info.relay_pubkey.clone(),
            info.epoch.clone(),
        );
        self.mailbox
            .run(move |c| {
                // Read first: in the steady state nothing is written.
                let cached = state::enrolment(c, &url)?;
                let why = match &cached {
                    Some(e) if e.host_pubkey != me => Some("this host key changed"),
                    Some(e) if e.relay_pubkey != relay_key => Some("the relay key changed"),
                    Some(e) if e.epoch != epoch => Some("new relay epoch"),
                    _ => None,
                };
                if cached.is_none() {
                    state::set_enrolment(
                        c,
                        &url,
                        &Enrolment {
                            relay_pubkey: relay_key,
                            epoch,
                            host_pubkey: me,
                            at: iso_ms(now),
                        },
                    )?;
                }
                Ok(why)
            })
            .await
            .map_err(RelayError::from)
    }

    /// Challenge, enrol and confirm with signed info (spec §8), unless a backoff episode says
    /// not yet. The cache, this host's published ad and allowlist records are dropped first (a
    /// store that enrols this host anew holds nothing of it); a lost enrolment is audited
    /// `relay.enrolment_lost`, a new one `relay.enrolled`, a refusal `relay.enrol_failed`.
    /// Returns the confirming info. Errors: [`RelayError::Refused`] (backoff, denied, revoked,
    /// refused right after enrolment), the enrolment's own errors, storage failures.
    async fn enrol_and_confirm(
        &self,
        info: &RelayInfo,
        why: &'static str,
    ) -> Result<RelayInfo, RelayError> {
        let (url, now, epoch) = (self.url.clone(), self.clock.now_ms(), info.epoch.clone());
        let waiting = self
            .mailbox
            .run(move |c| {
                Ok(state::backoff(c, &url)?
                    .filter(|b| b.holds_at(now))
                    .map(|b| (b, state::state(c, &url).ok().flatten())))
            })
            .await?;
        if let Some((b, st)) = waiting {
            let st = st.filter(|s| {
                matches!(
                    s.state,
                    Standing::ClockSkew
                        | Standing::RefusedAfterEnrol
                        | Standing::Denied
                        | Standing::Revoked
                )
            });
            return Err(RelayError::Refused {
                standing: st.as_ref().map_or(Standing::RefusedAfterEnrol, |s| s.state),
                detail: st
                    .and_then(|s| s.detail)
                    .unwrap_or_else(|| "refused after enrolment".into()),
                retry_at_ms: b.next_at,
            });
        }
        let url = self.url.clone();
        let lost = self
            .mailbox
            .run(move |c| {
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let had = state::enrolment(&tx, &url)?;
                state::forget_enrolment(&tx, &url)?;
                state::kv_delete(&tx, &state::enc_ad_kv(&url))?;
                state::kv_delete(&tx, &state::senders_kv(&url))?;
                if let Some(had) = &had {
                    audit::record(
                        &tx,
                        now,
                        "relay.enrolment_lost",
                        &json!({"relay": url, "epoch": epoch, "was_epoch": had.epoch, "why": why}),
                    )?;
                }
                tx.commit()?;
                Ok(had.is_some())
            })
            .await?;
        // Said at once only when the relay answered 401 NOT_ENROLLED; for the other reasons
        // (no `you` in signed info, a new epoch…) only once the relay took this host again, so
        // that a deny or a revocation (403 to the enrolment) is never announced as a lost
        // enrolment.
        let after_401 = why == NOT_ENROLLED_401;
        if lost && after_401 {
            tracing::warn!(relay = %self.url, reason = why, "the relay lost this host's enrolment: enrolling again");
        }
        if let Err(e) = self.enrol().await {
            return Err(match e {
                e @ (RelayError::Unreachable(_) | RelayError::Store(_)) => e,
                e if e.is_auth() && e.status() == Some(403) => {
                    self.refused_by_relay(&e, &info.epoch).await?
                }
                e => {
                    self.enrol_failed(&e, info).await?;
                    e
                }
            });
        }
        if lost && !after_401 {
            tracing::warn!(relay = %self.url, reason = why, "the relay had lost this host's enrolment: enrolled again");
        }
        let (url, now) = (self.url.clone(), self.clock.now_ms());
        let record = Enrolment {
            relay_pubkey: info.relay_pubkey.clone(),
            epoch: info.epoch.clone(),
            host_pubkey: self.ident.host_key.public().to_b64(),
            at: iso_ms(now),
        };
        let detail = json!({
            "relay": url,
            "epoch": info.epoch,
            "relay_key": self.relay_key.fingerprint(),
            "host_key": self.ident.host_key.public().fingerprint(),
            "why": why,
        });
        self.mailbox
            .run(move |c| {
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                state::set_enrolment(&tx, &url, &record)?;
                audit::record(&tx, now, "relay.enrolled", &detail)?;
                tx.commit()?;
                Ok(())
            })
            .await?;
        // The first signed request after the enrolment: the relay must now know this host.
        let again = self.signed_info().await?;
        self.check_relay_key(&again).await?;
        let me = self.ident.host_key.public().to_b64();
        if !is_me(&again, &me, self.ident.host.as_str()) {
            return Err(self.refused_after_enrol(&again.epoch).await?);
        }
        Ok(again)
    }

    /// Records a refused challenge or enrolment: state `enrol-failed`, audit
    /// `relay.enrol_failed` (once per distinct status), the cache dropped.
    async fn enrol_failed(&self, e: &RelayError, info: &RelayInfo) -> Result<(), RelayError> {
        let mut st = RelayState::new(Standing::EnrolFailed);
        st.status = e.status();
        st.detail = Some(cut(&e.to_string()));
        st.relay_fp = Some(self.relay_key.fingerprint());
        st.epoch = Some(info.epoch.clone());
        let (url, now) = (self.url.clone(), self.clock.now_ms());
        let detail = json!({"relay": url, "status": e.status(), "error": cut(&e.to_string())});
        let changed = self
            .mailbox
            .run(move |c| {
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let prev = state::state(&tx, &url)?;
                let same = prev.is_some_and(|p| p.state == st.state && p.status == st.status);
                if !same {
                    audit::record(&tx, now, "relay.enrol_failed", &detail)?;
                }
                state::forget_enrolment(&tx, &url)?;
                state::set_state(&tx, &url, st, now)?;
                tx.commit()?;
                Ok(!same)
            })
            .await?;
        if changed {
            tracing::warn!(relay = %self.url, error = %e, "relay enrolment refused; retrying on later passes");
        }
        Ok(())
    }

    /// A refusal right after a fresh enrolment (no `you` in the confirming info, or a 401):
    /// backoff 1 min doubling to 1 h, classified from the relay's `Date` header as
    /// `clock-skew` or `refused-after-enrol`, audited `relay.enrol_failed` once per episode.
    /// Returns the error that ends the pass. Errors: storage failures.
    pub async fn refused_after_enrol(&self, epoch: &str) -> Result<RelayError, RelayError> {
        let now = self.clock.now_ms();
        let (standing, detail, off) =
            state::classify_refusal(self.observed.last_date().as_deref(), now);
        self.back_off(standing, Some(401), detail, off, epoch).await
    }

    /// A 403 from the relay: `REVOKED` is the state `revoked` (the operator revoked this host
    /// key for good), `DENIED` or a 403 with another or no code the state `denied` (for now),
    /// each with the enrolment backoff so it never becomes a hot loop. An enrolment authority
    /// that cannot decide is not a 403 but a 503 `AUTHORITY_UNAVAILABLE`
    /// ([`RelayError::AuthorityUnavailable`]), recorded as `enrol-failed` instead. Returns the
    /// error that ends the pass. Errors: storage failures.
    pub async fn refused_by_relay(
        &self,
        e: &RelayError,
        epoch: &str,
    ) -> Result<RelayError, RelayError> {
        let (standing, detail) = refusal_of(e);
        self.back_off(standing, Some(403), detail, None, epoch)
            .await
    }

    async fn back_off(
        &self,
        standing: Standing,
        status: Option<u16>,
        detail: String,
        off_ms: Option<i64>,
        epoch: &str,
    ) -> Result<RelayError, RelayError> {
        let (url, now) = (self.url.clone(), self.clock.now_ms());
        let mut st = RelayState::new(standing);
        st.status = status;
        st.detail = Some(detail.clone());
        st.relay_fp = Some(self.relay_key.fingerprint());
        st.epoch = Some(epoch.to_string());
        let (b, changed) = self
            .mailbox
            .run(move |c| {
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let b = state::bump_backoff(&tx, &url, now)?;
                state::forget_enrolment(&tx, &url)?;
                if b.n == 1 {
                    audit::record(
                        &tx,
                        now,
                        "relay.enrol_failed",
                        &json!({"relay": url, "reason": standing.as_str(), "status": status, "off_ms": off_ms}),
                    )?;
                }
                st.next_at = Some(iso_ms(b.next_at));
                let changed = state::set_state(&tx, &url, st, now)?;
                tx.commit()?;
                Ok((b, changed || b.n == 1))
            })
            .await?;
        if changed {
            tracing::error!(relay = %self.url, state = %standing, retry_at = %iso_ms(b.next_at), "{detail}");
        }
        Ok(RelayError::Refused {
            standing,
            detail,
            retry_at_ms: b.next_at,
        })
    }

    /// This host's records at the relay: its enc-key ad, then its sender allowlist. Errors
    /// that concern this host's standing (401, 403) and storage failures end the step; the
    /// others are reported in the outcome (the ad) or logged (the allowlist).
    async fn publish_owned(&self, info: &RelayInfo, fresh: bool) -> Result<AdOutcome, RelayError> {
        let ad = self.ensure_enc_ad(info, fresh).await?;
        self.publish_allowlist().await?;
        Ok(ad)
    }

    /// Publishes this host's ad when [`ad_due`] says so or right after a `fresh` enrolment
    /// (spec §8: challenge, enrol and enc-ad publish), else adopts the relay's fresh copy.
    async fn ensure_enc_ad(&self, info: &RelayInfo, fresh: bool) -> Result<AdOutcome, RelayError> {
        let now = self.clock.now_ms();
        let host_pubkey = self.ident.host_key.public().to_b64();
        let enc_pub = self.ident.enc_key.public().to_b64();
        let served = info.you.as_ref().and_then(|y| y.enc_ad.clone());
        let url = self.url.clone();
        let published = self
            .mailbox
            .run(move |c| state::published_ad(c, &url))
            .await?;
        let due = if fresh {
            Some("fresh enrolment")
        } else {
            ad_due(
                published.as_ref(),
                served.as_ref(),
                &host_pubkey,
                &enc_pub,
                &info.epoch,
                now,
            )
        };
        match due {
            None => {
                if let Some(p) = published {
                    return Ok(AdOutcome::Current { exp: p.exp });
                }
                // The relay already holds a fresh ad of ours (a new mailbox, same keys).
                let exp = served
                    .as_ref()
                    .and_then(|a| parse_iso_ms(&a.exp))
                    .unwrap_or(now);
                let rec = PublishedAd {
                    host_pubkey,
                    enc_pub,
                    iat: exp - ENC_AD_TTL_MS,
                    exp,
                    epoch: info.epoch.clone(),
                };
                let url = self.url.clone();
                self.mailbox
                    .run(move |c| state::set_published_ad(c, &url, &rec))
                    .await?;
                Ok(AdOutcome::Current { exp })
            }
            Some(why) => {
                tracing::debug!(relay = %self.url, reason = why, "publishing the enc-key ad");
                match self.publish_enc_ad().await {
                    Ok(()) => Ok(AdOutcome::Published {
                        exp: now + ENC_AD_TTL_MS,
                    }),
                    Err(e) if e.is_auth() => Err(e),
                    Err(e @ RelayError::Store(_)) => Err(e),
                    Err(e) => Ok(AdOutcome::Failed {
                        status: e.status(),
                        detail: cut(&e.to_string()),
                    }),
                }
            }
        }
    }

    /// Host-key challenge enrolment: `POST /v1/relay/challenge` then `POST /v1/relay/enrol`
    /// with the signature over canonical(`{v:1, challenge, host, pubkey, owner_fp}`). On an
    /// account relay the body also carries `proof = {token, cloud_cert, cloud_pop}` (the cloud
    /// key's proof of possession signs the challenge), and only once the relay key was
    /// confirmed in this pass: called before that, it sends nothing and answers
    /// [`RelayError::Token`].
    pub async fn enrol(&self) -> Result<(), RelayError> {
        if self.account.is_some() && !self.relay_key_confirmed() {
            return Err(RelayError::Token(
                "the relay key was not confirmed in this pass; the account token is not sent"
                    .into(),
            ));
        }
        let host = self.ident.host.as_str();
        let pubkey = self.ident.host_key.public().to_b64();
        let body = json!({"host": host, "pubkey": pubkey}).to_string();
        let ch: ChallengeResponse = self.post_plain("/v1/relay/challenge", &body).await?;
        let sig = self
            .ident
            .host_key
            .sign(records::enrol_canonical(&ch.challenge, host, &pubkey, "").as_bytes());
        let mut body = json!({"host": host, "pubkey": pubkey, "owner_fp": "", "sig": sig});
        if let Some(account) = &self.account {
            // Account relays (spec §8): the token, the host-certified cloud key and its proof of
            // possession over this challenge.
            body["proof"] = account
                .enrol_proof(&self.ident, &ch.challenge)
                .await
                .map_err(|e| RelayError::Token(e.to_string()))?;
        }
        let body = body.to_string();
        let _: serde_json::Value = self.post_plain("/v1/relay/enrol", &body).await?;
        tracing::info!(relay = %self.url, "enrolled with the relay");
        Ok(())
    }

    /// Publishes a fresh signed v2 enc-key ad (`POST /v2/relay/enc-key {ad, sig}`, valid
    /// [`ENC_AD_TTL_MS`]) and records it (kv `relay-enc-ad:<url>`) with the current epoch.
    pub async fn publish_enc_ad(&self) -> Result<(), RelayError> {
        let now = self.clock.now_ms();
        let ad = EncAd::new(
            self.ident.host.as_str(),
            &self.ident.host_key.public(),
            &self.ident.enc_key.public().to_b64(),
            now,
        );
        let sig = ad.sign(&self.ident.host_key);
        let body = json!({"ad": ad.to_value(), "sig": sig}).to_string();
        let _: serde_json::Value = self.call_json("POST", "/v2/relay/enc-key", &body).await?;
        let url = self.url.clone();
        let rec = PublishedAd {
            host_pubkey: ad.host_pubkey.clone(),
            enc_pub: ad.enc_pub.clone(),
            iat: now,
            exp: now + ENC_AD_TTL_MS,
            epoch: String::new(),
        };
        self.mailbox
            .run(move |c| {
                let epoch = kv_get(c, &state::epoch_kv(&url))?.unwrap_or_default();
                state::set_published_ad(c, &url, &PublishedAd { epoch, ..rec })
            })
            .await?;
        tracing::info!(relay = %self.url, "published the enc-key ad");
        Ok(())
    }

    async fn post_plain<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &str,
    ) -> Result<T, RelayError> {
        let resp = self
            .http
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
        let status = resp.status().as_u16();
        let bytes = super::answer::read_capped(resp, super::answer::MAX_ANSWER).await?;
        if !(200..300).contains(&status) {
            return Err(status_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| RelayError::Malformed(e.to_string()))
    }
}

/// The verdict and the sentence for a person on a 403 from the relay
/// ([`RelayClient::refused_by_relay`]): code `REVOKED` is [`Standing::Revoked`], anything else
/// [`Standing::Denied`]. The relay's own words are kept (at most 120 characters, anything but
/// printable ASCII escaped).
pub fn refusal_of(e: &RelayError) -> (Standing, String) {
    let (code, said) = match e {
        RelayError::Status { body: Some(b), .. } => (b.code.as_str(), printable(&b.error, 120)),
        RelayError::Status { error, .. } => ("", printable(error, 120)),
        _ => ("", String::new()),
    };
    let said = if said.is_empty() {
        String::new()
    } else {
        format!(": {said}")
    };
    if code == "REVOKED" {
        (
            Standing::Revoked,
            format!("the relay's operator revoked this host key for good (REVOKED{said}): this host key can never use this relay again; nothing is pushed to or pulled from it"),
        )
    } else {
        let code = if code.is_empty() {
            "403".to_string()
        } else {
            printable(code, 40)
        };
        (
            Standing::Denied,
            format!("the relay refuses this host for now ({code}{said}): nothing is pushed or pulled until its operator lifts the deny"),
        )
    }
}

/// `text` cut to `max` characters, every character outside printable ASCII escaped (`\u{…}`),
/// so a relay's words never carry control sequences into a terminal.
fn printable(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars().take(max) {
        if c == ' ' || c.is_ascii_graphic() {
            out.push(c);
        } else {
            out.extend(c.escape_default());
        }
    }
    out
}

/// An error text cut to 300 characters for the relay state and audit (never a body).
fn cut(text: &str) -> String {
    text.chars().take(300).collect()
}

/// The detail of an `unreachable` standing for `e`: the cause alone for
/// [`RelayError::Unreachable`] (the standing already says unreachable), else `e`'s text.
fn unreachable_detail(e: &RelayError) -> String {
    match e {
        RelayError::Unreachable(why) => why.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests;
