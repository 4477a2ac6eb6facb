//! What this host knows about its standing with a relay (spec §1, §8; `wire.md` §3.5), kept in
//! the mailbox kv table so that `agentmbx relay info` (and doctor, later) can read it with no
//! daemon running:
//!
//! - `relay-state:<url>`: the last verdict of the relay loop, JSON [`RelayState`] `{state:
//!   ok|unreachable|key-mismatch|enrol-failed|enc-ad-failed|clock-skew|refused-after-enrol|
//!   denied|revoked, at, detail?, status?, relay_fp?, pinned_fp?, epoch?, next_at?,
//!   enc_ad_exp?}`; `at` is when that state began and is kept while the state stays the same;
//! - `relay-key:<url>` (the pinned relay key, base64) and `relay-key-expect:<url>` (the
//!   fingerprint `relay set --key` named while the relay was unreachable: only that key may be
//!   pinned on first contact);
//! - `relay-key-mismatch:<url>`: [`KeyChange`], the relay served another key than the pinned
//!   one; kept until the owner confirms a key, even after the relay serves the pinned key again;
//! - `relay-enrolled:<url>`: the enrolment cache [`Enrolment`], valid only for the same relay
//!   key, epoch and host key (spec §8: a cache, never a permanent "enrolled" flag);
//! - `relay-enrol-backoff:<url>`: [`Backoff`] after a refusal right after a fresh enrolment, a
//!   deny or a revocation (1 min doubling to 1 h);
//! - `relay-enc-ad:<url>`: [`PublishedAd`], this host's last published v2 enc-key ad;
//! - `relay-senders:<url>`: the last published sender allowlist ([`super::allowlist`]);
//! - `relay-enc-newest:<peer host key>` and `relay-enc-rejected:<peer>`: the enc-key ad rollback
//!   guard per peer host key and the last refusal of a relay-served ad (`wire.md` §2.8);
//!   [`accept_enc_ad`] is the one step the push calls with a relay-served ad.
//!
//! Audit events (`relay.key_changed`, `relay.key_confirmed`, `enc_key.rejected`) are written in
//! the same transaction as the state they describe. This module never stores private keys,
//! tokens or bodies: public keys, fingerprints, times and reasons only. It performs no network
//! I/O.

use rusqlite::Connection;
use serde::{Deserialize, Serialize};
use serde_json::json;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::records::EncAd;
use agentmbx_protocol::time::iso_ms;

use crate::mailbox::relay_state::{kv_get, kv_set};
use crate::mailbox::{audit, peers, MailboxError};

/// The relay's hop window (`wire.md` §2.6: ±300,000 ms). A refusal right after a fresh
/// enrolment while the relay's `Date` is further than this from our clock is `clock-skew`.
pub const HOP_WINDOW_MS: i64 = 300_000;
/// First pause after a refusal right after enrolment, or a revocation (ms): 1 minute.
pub const ENROL_BACKOFF_BASE_MS: i64 = 60_000;
/// Longest such pause (ms): 1 hour.
pub const ENROL_BACKOFF_MAX_MS: i64 = 3_600_000;

/// Where this host stands with a relay (`wire.md` §3.5 relay-state; `denied` and `revoked` are
/// ours: the relay answered 403 `DENIED` or `REVOKED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Standing {
    /// The last session opened and the relay is in use.
    Ok,
    /// The relay could not be reached (or answered 5xx to info).
    Unreachable,
    /// The relay presents another key than the pinned (or expected) one: relay use stopped
    /// until the owner confirms with `relay set <url> --key <fp>` (spec §1).
    KeyMismatch,
    /// Challenge or enrolment was refused.
    EnrolFailed,
    /// The enc-key ad could not be published (receiving still works).
    EncAdFailed,
    /// Refused right after a fresh enrolment while the relay's clock differs from ours by more
    /// than the hop window.
    ClockSkew,
    /// Refused right after a fresh enrolment with clocks that agree.
    RefusedAfterEnrol,
    /// The relay refuses this host for now (403 `DENIED`: a deny-list entry of its operator, or
    /// its enrolment authority said no; also a 403 with no known code). It may end: the daemon
    /// tries again after its backoff.
    Denied,
    /// The relay's operator revoked this host key (403 `REVOKED`): for good, this key can never
    /// use that relay again (re-enrolment and rotation from it are refused).
    Revoked,
}

impl Standing {
    /// The wire name (`key-mismatch`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Standing::Ok => "ok",
            Standing::Unreachable => "unreachable",
            Standing::KeyMismatch => "key-mismatch",
            Standing::EnrolFailed => "enrol-failed",
            Standing::EncAdFailed => "enc-ad-failed",
            Standing::ClockSkew => "clock-skew",
            Standing::RefusedAfterEnrol => "refused-after-enrol",
            Standing::Denied => "denied",
            Standing::Revoked => "revoked",
        }
    }
}

impl std::fmt::Display for Standing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// kv `relay-state:<url>` (`wire.md` §3.5). Times are ISO ms strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayState {
    /// The verdict.
    pub state: Standing,
    /// Since when (the first pass that found this state), ISO ms.
    pub at: String,
    /// What happened, for a person (never key material).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The HTTP status behind it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Fingerprint of the key the relay served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_fp: Option<String>,
    /// key-mismatch: fingerprint of the pinned (or expected) key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_fp: Option<String>,
    /// The relay epoch seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<String>,
    /// clock-skew, refused-after-enrol, denied, revoked: when the next enrolment attempt is due
    /// (ISO ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_at: Option<String>,
    /// Expiry of this host's v2 enc-key ad at the relay (ISO ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enc_ad_exp: Option<String>,
}

impl RelayState {
    /// A state with only its verdict set (`at` is filled in by [`set_state`]).
    pub fn new(state: Standing) -> Self {
        RelayState {
            state,
            at: String::new(),
            detail: None,
            status: None,
            relay_fp: None,
            pinned_fp: None,
            epoch: None,
            next_at: None,
            enc_ad_exp: None,
        }
    }

    /// What the owner can do, for the states that need a person: for a key mismatch the command
    /// that confirms the served key; for `denied` and `revoked` a sentence (only the relay's
    /// operator can act). `None` for the others.
    pub fn fix(&self, url: &str) -> Option<String> {
        match self.state {
            Standing::KeyMismatch => Some(format!(
                "agentmbx relay set {url} --key {}",
                self.relay_fp.as_deref().unwrap_or("<fingerprint>")
            )),
            Standing::Denied => Some(DENIED_FIX.to_string()),
            Standing::Revoked => Some(REVOKED_FIX.to_string()),
            _ => None,
        }
    }
}

/// The `fix` of the `denied` state ([`RelayState::fix`]).
pub const DENIED_FIX: &str = "ask the relay's operator to lift the deny for this host (`agentmbx whoami` shows its fingerprint); the daemon tries again by itself, 1 min doubling to 1 h";

/// The `fix` of the `revoked` state ([`RelayState::fix`]): revocation is for good, and the relay
/// also refuses a rotation away from a revoked key.
pub const REVOKED_FIX: &str =
    "none on this relay: this host key can never use this relay again; ask its operator";

/// kv key of the relay state of `url`.
pub fn state_kv(url: &str) -> String {
    format!("relay-state:{}", norm(url))
}
/// kv key of the pinned relay key of `url` (base64).
pub fn key_kv(url: &str) -> String {
    format!("relay-key:{}", norm(url))
}
/// kv key of the expected relay key fingerprint of `url` (`relay set --key` while unreachable).
pub fn expect_kv(url: &str) -> String {
    format!("relay-key-expect:{}", norm(url))
}
/// kv key of the epoch last seen at `url`.
pub fn epoch_kv(url: &str) -> String {
    format!("relay-epoch:{}", norm(url))
}
/// kv key of the enrolment cache of `url`.
pub fn enrolled_kv(url: &str) -> String {
    format!("relay-enrolled:{}", norm(url))
}
/// kv key of the enrolment backoff of `url`.
pub fn backoff_kv(url: &str) -> String {
    format!("relay-enrol-backoff:{}", norm(url))
}
/// kv key of this host's last published enc-key ad at `url`.
pub fn enc_ad_kv(url: &str) -> String {
    format!("relay-enc-ad:{}", norm(url))
}
/// kv key of the last published sender allowlist at `url`.
pub fn senders_kv(url: &str) -> String {
    format!("relay-senders:{}", norm(url))
}
/// kv key of the record of a served relay key other than the pinned one ([`KeyChange`]).
pub fn mismatch_kv(url: &str) -> String {
    format!("relay-key-mismatch:{}", norm(url))
}
/// kv key of the rollback guard of a peer host key (newest accepted `{iat, enc_pub}`).
pub fn enc_newest_kv(peer_pubkey: &str) -> String {
    format!("relay-enc-newest:{peer_pubkey}")
}
/// kv key of the last refusal of a relay-served enc-key ad for peer `host`.
pub fn enc_rejected_kv(host: &str) -> String {
    format!("relay-enc-rejected:{host}")
}

fn norm(url: &str) -> &str {
    url.trim_end_matches('/')
}

/// Deletes one kv key (exactly that key). Errors: SQLite failures.
pub fn kv_delete(conn: &Connection, k: &str) -> Result<bool, MailboxError> {
    Ok(conn.execute("DELETE FROM kv WHERE k = ?1", [k])? > 0)
}

fn get_json<T: serde::de::DeserializeOwned>(
    conn: &Connection,
    k: &str,
) -> Result<Option<T>, MailboxError> {
    // A value that does not parse (an older or damaged record) reads as absent.
    Ok(kv_get(conn, k)?.and_then(|v| serde_json::from_str(&v).ok()))
}

fn set_json<T: Serialize>(conn: &Connection, k: &str, v: &T) -> Result<(), MailboxError> {
    let text = serde_json::to_string(v).map_err(|e| MailboxError::Invalid(e.to_string()))?;
    kv_set(conn, k, &text)
}

// ---- what the last answers said -----------------------------------------------------------------

/// What this client saw in the relay's recent answers (in memory, per client): the `Date`
/// header of the last answer, which classifies a refusal right after enrolment.
#[derive(Debug, Default)]
pub struct Observed {
    last_date: std::sync::Mutex<Option<String>>,
}

impl Observed {
    /// Records the `Date` header of an answer (`None` when it had none).
    pub fn note_date(&self, date: Option<&str>) {
        if let Ok(mut d) = self.last_date.lock() {
            *d = date.map(|s| s.chars().take(64).collect());
        }
    }

    /// The `Date` header of the last answer, if it had one.
    pub fn last_date(&self) -> Option<String> {
        self.last_date.lock().ok().and_then(|d| d.clone())
    }
}

// ---- relay state ---------------------------------------------------------------------------------

/// The relay state of `url`, if any. Errors: SQLite failures.
pub fn state(conn: &Connection, url: &str) -> Result<Option<RelayState>, MailboxError> {
    get_json(conn, &state_kv(url))
}

/// Records `st` for `url`: `at` is kept from the previous record when the verdict is the same,
/// else set to `now_ms`; an identical record is not rewritten. Returns true when the verdict
/// changed (callers log once per change, not every pass). Errors: SQLite failures.
pub fn set_state(
    conn: &Connection,
    url: &str,
    mut st: RelayState,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let prev = state(conn, url)?;
    let changed = prev.as_ref().is_none_or(|p| p.state != st.state);
    st.at = match prev {
        Some(p) if !changed => p.at,
        _ => iso_ms(now_ms),
    };
    let k = state_kv(url);
    let text = serde_json::to_string(&st).map_err(|e| MailboxError::Invalid(e.to_string()))?;
    if kv_get(conn, &k)?.as_deref() != Some(text.as_str()) {
        kv_set(conn, &k, &text)?;
    }
    Ok(changed)
}

/// Like [`set_state`], but never replaces a `key-mismatch`: only the owner's confirmation
/// ([`confirm_key`]) or the relay serving the pinned key again ends it. Returns true when the
/// verdict changed. Errors: SQLite failures.
pub fn note_state(
    conn: &Connection,
    url: &str,
    st: RelayState,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    if state(conn, url)?.is_some_and(|p| p.state == Standing::KeyMismatch) {
        return Ok(false);
    }
    set_state(conn, url, st, now_ms)
}

/// kv `relay-key-mismatch:<url>` (`wire.md` §3.5): the relay served `served` where `pinned`
/// was pinned (`how` = `pinned`) or expected (`how` = `expected`), first at `at` (ISO ms). It
/// stays when the relay serves the pinned key again (relay use then resumes with the pinned
/// key, which is safe), and only the owner's [`confirm_key`] ends it: with the served key, or
/// with the pinned one to keep it (spec §1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyChange {
    /// `pinned` or `expected`.
    pub how: String,
    /// Fingerprint of the pinned (or expected) key.
    pub pinned: String,
    /// Fingerprint of the key the relay served instead.
    pub served: String,
    /// When that key was first served (ISO ms).
    pub at: String,
}

/// The unconfirmed relay key change of `url`, if any. Errors: SQLite failures.
pub fn key_change(conn: &Connection, url: &str) -> Result<Option<KeyChange>, MailboxError> {
    get_json(conn, &mismatch_kv(url))
}

/// Records that `url` serves `served_fp` where `pinned_fp` was pinned (`how` = `pinned`) or
/// expected (`how` = `expected`): state `key-mismatch` and, once per distinct served key, the
/// audit event `relay.key_changed {relay, pinned|expected, served}`, and the [`KeyChange`]
/// record, in one transaction. Nothing is recorded when the stored pin already names the served key (the owner confirmed
/// it while the pass ran). Returns true when the event was recorded now (the caller logs it).
/// Errors: SQLite failures.
pub fn record_key_mismatch(
    conn: &mut Connection,
    url: &str,
    how: &str,
    pinned_fp: &str,
    served_fp: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    // The owner may have confirmed the served key while this pass was under way.
    let pin_now = match kv_get(&tx, &key_kv(url))? {
        Some(k) => PublicKey::from_b64(&k).ok().map(|k| k.fingerprint()),
        None => kv_get(&tx, &expect_kv(url))?,
    };
    if pin_now.as_deref() == Some(served_fp) {
        return Ok(false);
    }
    let prev = state(&tx, url)?;
    let known = prev.as_ref().is_some_and(|p| {
        p.state == Standing::KeyMismatch
            && p.relay_fp.as_deref() == Some(served_fp)
            && p.pinned_fp.as_deref() == Some(pinned_fp)
    });
    // The unconfirmed change outlives the state (the relay may serve the pinned key in
    // between): the same served key is audited once until the owner confirms.
    let record = key_change(&tx, url)?
        .filter(|r| r.served == served_fp && r.pinned == pinned_fp && r.how == how);
    if record.is_none() {
        let change = KeyChange {
            how: how.to_string(),
            pinned: pinned_fp.to_string(),
            served: served_fp.to_string(),
            at: iso_ms(now_ms),
        };
        set_json(&tx, &mismatch_kv(url), &change)?;
    }
    let audited = !known && record.is_none();
    if audited {
        let mut detail = serde_json::Map::new();
        detail.insert("relay".into(), json!(norm(url)));
        detail.insert(how.into(), json!(pinned_fp));
        detail.insert("served".into(), json!(served_fp));
        audit::record(&tx, now_ms, "relay.key_changed", &detail.into())?;
    }
    let mut st = RelayState::new(Standing::KeyMismatch);
    st.detail = Some(format!("{how} {pinned_fp}, served {served_fp}"));
    st.relay_fp = Some(served_fp.to_string());
    st.pinned_fp = Some(pinned_fp.to_string());
    if known {
        // Same mismatch as before: keep `at`, the episode goes on.
        st.at = prev.map(|p| p.at).unwrap_or_default();
        let text = serde_json::to_string(&st).map_err(|e| MailboxError::Invalid(e.to_string()))?;
        kv_set(&tx, &state_kv(url), &text)?;
    } else {
        // A new served key starts a new episode.
        kv_delete(&tx, &state_kv(url))?;
        set_state(&tx, url, st, now_ms)?;
    }
    tx.commit()?;
    Ok(audited)
}

/// What [`confirm_key`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirmation {
    /// Fingerprint of the key pinned before, if any.
    pub previous: Option<String>,
    /// True when the pin changed (and `relay.key_confirmed` was audited).
    pub changed: bool,
}

/// The owner's pin for `url` (`relay set`, spec §1): with `key`, pins it (`relay-key:<url>`)
/// and drops any expectation; with only `expect_fp` (the relay was unreachable), drops the pin
/// and records the expectation, so the daemon later pins only a key with that fingerprint. A
/// `key-mismatch` state and the [`KeyChange`] record are cleared; a change of pin is audited
/// `relay.key_confirmed {relay, from, to[, pending]}`, and keeping the pinned key after a
/// recorded change `relay.key_confirmed {relay, from, to, kept: true, served}`. One
/// transaction. Errors: SQLite failures.
pub fn confirm_key(
    conn: &mut Connection,
    url: &str,
    key: Option<&PublicKey>,
    expect_fp: Option<&str>,
    now_ms: i64,
) -> Result<Confirmation, MailboxError> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let previous_key = kv_get(&tx, &key_kv(url))?;
    let previous = previous_key
        .as_deref()
        .map(|k| PublicKey::from_b64(k).map_or_else(|_| "unparseable".into(), |k| k.fingerprint()));
    let previous_expect = kv_get(&tx, &expect_kv(url))?;
    let mismatch = state(&tx, url)?.filter(|s| s.state == Standing::KeyMismatch);
    let change = key_change(&tx, url)?;
    let (to, pending) = match (key, expect_fp) {
        (Some(k), _) => {
            kv_set(&tx, &key_kv(url), &k.to_b64())?;
            kv_delete(&tx, &expect_kv(url))?;
            (k.fingerprint(), false)
        }
        (None, Some(fp)) => {
            kv_delete(&tx, &key_kv(url))?;
            kv_set(&tx, &expect_kv(url), fp)?;
            (fp.to_string(), true)
        }
        (None, None) => {
            tx.commit()?;
            return Ok(Confirmation {
                previous,
                changed: false,
            });
        }
    };
    let before = previous.clone().or(previous_expect);
    let changed =
        before.as_deref() != Some(to.as_str()) && (before.is_some() || mismatch.is_some());
    // The owner keeps the pinned key after the relay served another one: also a decision.
    let kept = change.as_ref().filter(|_| !changed);
    if changed || kept.is_some() {
        let mut detail = json!({"relay": norm(url), "from": before, "to": to});
        if pending {
            detail["pending"] = json!(true);
        }
        if let Some(c) = kept {
            detail["kept"] = json!(true);
            detail["served"] = json!(c.served);
        }
        audit::record(&tx, now_ms, "relay.key_confirmed", &detail)?;
    }
    if mismatch.is_some() {
        kv_delete(&tx, &state_kv(url))?;
    }
    if change.is_some() {
        kv_delete(&tx, &mismatch_kv(url))?;
    }
    tx.commit()?;
    Ok(Confirmation {
        previous,
        changed: changed || mismatch.is_some() || change.is_some(),
    })
}

// ---- enrolment cache and backoff -----------------------------------------------------------------

/// kv `relay-enrolled:<url>`: the last enrolment this host confirmed at `url`, and what it is
/// for. It is only a cache (spec §8): it counts only while the relay key, the epoch and the host
/// key are the same, and the relay's signed info (`you`) decides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enrolment {
    /// The relay key the enrolment was made with (base64).
    pub relay_pubkey: String,
    /// The relay epoch it was confirmed in.
    pub epoch: String,
    /// This host's key it is for (base64).
    pub host_pubkey: String,
    /// When it was confirmed (ISO ms).
    pub at: String,
}

impl Enrolment {
    /// True when the cache is for this relay key, epoch and host key.
    pub fn matches(&self, relay_pubkey: &str, epoch: &str, host_pubkey: &str) -> bool {
        self.relay_pubkey == relay_pubkey && self.epoch == epoch && self.host_pubkey == host_pubkey
    }
}

/// The enrolment cache of `url`. Errors: SQLite failures.
pub fn enrolment(conn: &Connection, url: &str) -> Result<Option<Enrolment>, MailboxError> {
    get_json(conn, &enrolled_kv(url))
}

/// Writes the enrolment cache of `url`. Errors: SQLite failures.
pub fn set_enrolment(conn: &Connection, url: &str, e: &Enrolment) -> Result<(), MailboxError> {
    set_json(conn, &enrolled_kv(url), e)
}

/// Deletes the enrolment cache of `url`; true when there was one. Errors: SQLite failures.
pub fn forget_enrolment(conn: &Connection, url: &str) -> Result<bool, MailboxError> {
    kv_delete(conn, &enrolled_kv(url))
}

/// kv `relay-enrol-backoff:<url>`: the `n`-th refusal in a row and when to try again (ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backoff {
    /// Refusals in this episode (1 = the first).
    pub n: u32,
    /// No enrolment attempt before this time (ms since the epoch).
    pub next_at: i64,
}

/// Pause after the `n`-th refusal in a row (ms): 1 min, doubling, at most 1 h.
pub fn backoff_delay_ms(n: u32) -> i64 {
    let shift = n.saturating_sub(1).min(16);
    (ENROL_BACKOFF_BASE_MS << shift).min(ENROL_BACKOFF_MAX_MS)
}

impl Backoff {
    /// Whether this pause still holds at `now_ms`: `next_at` is ahead, but no further ahead
    /// than the pause of its `n`-th refusal ([`backoff_delay_ms`], at most
    /// [`ENROL_BACKOFF_MAX_MS`]). A `next_at` further ahead was written while the clock was
    /// ahead of the current one (a skew fixed since): the pause is over.
    pub fn holds_at(&self, now_ms: i64) -> bool {
        self.next_at > now_ms && self.next_at.saturating_sub(now_ms) <= backoff_delay_ms(self.n)
    }
}

/// The enrolment backoff of `url`, if any. Errors: SQLite failures.
pub fn backoff(conn: &Connection, url: &str) -> Result<Option<Backoff>, MailboxError> {
    get_json(conn, &backoff_kv(url))
}

/// Counts one more refusal and returns the new backoff. Errors: SQLite failures.
pub fn bump_backoff(conn: &Connection, url: &str, now_ms: i64) -> Result<Backoff, MailboxError> {
    let n = backoff(conn, url)?.map_or(0, |b| b.n).saturating_add(1);
    let b = Backoff {
        n,
        next_at: now_ms.saturating_add(backoff_delay_ms(n)),
    };
    set_json(conn, &backoff_kv(url), &b)?;
    Ok(b)
}

/// Ends a backoff episode (a signed answer confirmed the enrolment). Errors: SQLite failures.
pub fn clear_backoff(conn: &Connection, url: &str) -> Result<bool, MailboxError> {
    kv_delete(conn, &backoff_kv(url))
}

/// Classifies a refusal right after a fresh enrolment from the relay's `Date` header (`wire.md`
/// §3.5): an offset beyond [`HOP_WINDOW_MS`], or no usable `Date`, is `clock-skew`; otherwise
/// `refused-after-enrol` (the clocks agree, the cause is elsewhere). Returns the verdict, a
/// sentence for a person and the offset (our clock minus the relay's, ms) when known.
pub fn classify_refusal(date: Option<&str>, now_ms: i64) -> (Standing, String, Option<i64>) {
    let Some(relay_now) = date.and_then(parse_http_date) else {
        return (
            Standing::ClockSkew,
            "refused right after enrolment and the relay sent no usable Date header: this host's clock is likely more than 5 min off the relay's".into(),
            None,
        );
    };
    let off = now_ms - relay_now;
    if off.abs() > HOP_WINDOW_MS {
        let dir = if off > 0 { "ahead of" } else { "behind" };
        (
            Standing::ClockSkew,
            format!(
                "this host's clock is about {} min {dir} the relay's (the relay accepts 5): set the clock right (NTP)",
                (off.abs() + 30_000) / 60_000
            ),
            Some(off),
        )
    } else {
        (
            Standing::RefusedAfterEnrol,
            format!(
                "refused right after enrolment; the clocks agree ({} s apart), so the cause is not this host's clock",
                off.abs() / 1000
            ),
            Some(off),
        )
    }
}

/// Parses an HTTP `Date` (IMF-fixdate, RFC 9110 §5.6.7: `Sun, 06 Nov 1994 08:49:37 GMT`) into
/// ms since the epoch. Other forms are `None`.
pub fn parse_http_date(text: &str) -> Option<i64> {
    let parts: Vec<&str> = text.split_whitespace().collect();
    let [wd, day, mon, year, hms, "GMT"] = parts.as_slice() else {
        return None;
    };
    if !wd.ends_with(',') || day.len() != 2 || year.len() != 4 || hms.len() != 8 {
        return None;
    }
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let month = MONTHS.iter().position(|m| m == mon)? as i64 + 1;
    let num = |s: &str| -> Option<i64> {
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())
            .flatten()
    };
    let (d, y) = (num(day)?, num(year)?);
    let t: Vec<&str> = hms.split(':').collect();
    let [h, mi, s] = t.as_slice() else {
        return None;
    };
    let (h, mi, s) = (num(h)?, num(mi)?, num(s)?);
    if !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    // Days from the civil date (proleptic Gregorian), H. Hinnant's algorithm.
    let (yy, mm) = if month <= 2 {
        (y - 1, month + 9)
    } else {
        (y, month - 3)
    };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * mm + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + h) * 60 + mi) * 60_000 + s * 1000)
}

// ---- enc-key ads -----------------------------------------------------------------------------------

/// kv `relay-enc-ad:<url>`: the v2 enc-key ad this host last published there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishedAd {
    /// Host key it names (base64).
    pub host_pubkey: String,
    /// Enc key it names (base64).
    pub enc_pub: String,
    /// Issue time (ms).
    pub iat: i64,
    /// Expiry (ms).
    pub exp: i64,
    /// The relay epoch it was published in.
    pub epoch: String,
}

/// This host's last published ad at `url`. Errors: SQLite failures.
pub fn published_ad(conn: &Connection, url: &str) -> Result<Option<PublishedAd>, MailboxError> {
    get_json(conn, &enc_ad_kv(url))
}

/// Records a published ad. Errors: SQLite failures.
pub fn set_published_ad(
    conn: &Connection,
    url: &str,
    ad: &PublishedAd,
) -> Result<(), MailboxError> {
    set_json(conn, &enc_ad_kv(url), ad)
}

/// The rollback guard of `wire.md` §2.8 per peer host key: accepts the ad `{iat_ms, enc_pub}`
/// unless the newest accepted one names another key and this one is not newer; an accepted newer
/// ad becomes the newest. `Ok(Err(reason))` is a refusal (`rolled back: …`), nothing changed.
/// Errors: SQLite failures.
pub fn guard_enc_ad(
    conn: &Connection,
    peer_pubkey: &str,
    enc_pub: &str,
    iat_ms: i64,
) -> Result<Result<(), String>, MailboxError> {
    #[derive(Serialize, Deserialize)]
    struct Newest {
        iat: i64,
        enc_pub: String,
    }
    let k = enc_newest_kv(peer_pubkey);
    let newest: Option<Newest> = get_json(conn, &k)?;
    if let Some(n) = &newest {
        if n.enc_pub != enc_pub && iat_ms <= n.iat {
            return Ok(Err(format!(
                "rolled back: the relay served an ad from {} naming key {}, not newer than the ad from {} naming {} already accepted",
                iso_ms(iat_ms),
                enc_fp(enc_pub),
                iso_ms(n.iat),
                enc_fp(&n.enc_pub)
            )));
        }
    }
    if newest.as_ref().is_none_or(|n| iat_ms > n.iat) {
        set_json(
            conn,
            &k,
            &Newest {
                iat: iat_ms,
                enc_pub: enc_pub.to_string(),
            },
        )?;
    }
    Ok(Ok(()))
}

/// A short fingerprint of a base64 enc key (the first 16 hex digits of SHA-256 of its bytes, as
/// for host keys), for messages; never the key itself.
pub fn enc_fp(enc_pub_b64: &str) -> String {
    let raw = agentmbx_protocol::b64::decode(enc_pub_b64).unwrap_or_default();
    agentmbx_protocol::keys::fingerprint(&raw)
}

/// Records why a relay-served enc-key ad for peer `host` was refused (kv
/// `relay-enc-rejected:<host>` `{reason, at}`), auditing `enc_key.rejected {host, via:"relay",
/// reason}` once per distinct reason. Returns true when audited now. Errors: SQLite failures.
pub fn note_enc_refusal(
    conn: &mut Connection,
    host: &str,
    reason: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    #[derive(Serialize, Deserialize)]
    struct Refusal {
        reason: String,
        at: String,
    }
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let k = enc_rejected_kv(host);
    let prev: Option<Refusal> = get_json(&tx, &k)?;
    let new = prev.as_ref().is_none_or(|p| p.reason != reason);
    if new {
        audit::record(
            &tx,
            now_ms,
            "enc_key.rejected",
            &json!({"host": host, "via": "relay", "reason": reason}),
        )?;
        set_json(
            &tx,
            &k,
            &Refusal {
                reason: reason.to_string(),
                at: iso_ms(now_ms),
            },
        )?;
    }
    tx.commit()?;
    Ok(new)
}

/// Records the verdict on a relay-served enc-key ad for peer `host` (pinned host key
/// `peer_pubkey`, `wire.md` §2.8) and returns it: a refused `verdict` is noted
/// ([`note_enc_refusal`]); a valid ad passes the rollback guard ([`guard_enc_ad`]) and is
/// stored as the peer's enc key ([`crate::mailbox::peers::set_enc_key`]), its refusal record
/// cleared, in one immediate transaction; when either refuses it (`rolled back: …`) nothing
/// of that transaction is kept and the refusal is noted instead. `Ok(Err(reason))` is a
/// refusal. Errors: SQLite failures.
pub fn accept_enc_ad(
    conn: &mut Connection,
    host: &str,
    peer_pubkey: &str,
    verdict: Result<EncAd, String>,
    now_ms: i64,
) -> Result<Result<EncAd, String>, MailboxError> {
    let ad = match verdict {
        Ok(ad) => ad,
        Err(why) => {
            note_enc_refusal(conn, host, &why, now_ms)?;
            return Ok(Err(why));
        }
    };
    let iat = agentmbx_protocol::time::parse_iso_ms(&ad.iat).unwrap_or(0);
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let mut why = guard_enc_ad(&tx, peer_pubkey, &ad.enc_pub, iat)?.err();
    if why.is_none() && !peers::set_enc_key(&tx, host, &ad.enc_pub, iat)? {
        why = Some(format!(
            "rolled back: the relay served an ad from {} naming another key than the newer one already accepted",
            ad.iat
        ));
    }
    match why {
        None => {
            clear_enc_refusal(&tx, host)?;
            tx.commit()?;
            Ok(Ok(ad))
        }
        Some(why) => {
            drop(tx);
            note_enc_refusal(conn, host, &why, now_ms)?;
            Ok(Err(why))
        }
    }
}

/// The last refusal reason recorded for peer `host`, if any. Errors: SQLite failures.
pub fn enc_refusal(conn: &Connection, host: &str) -> Result<Option<String>, MailboxError> {
    Ok(get_json::<serde_json::Value>(conn, &enc_rejected_kv(host))?
        .and_then(|v| v.get("reason").and_then(|r| r.as_str()).map(String::from)))
}

/// Clears the refusal record of peer `host` (a valid ad arrived). Errors: SQLite failures.
pub fn clear_enc_refusal(conn: &Connection, host: &str) -> Result<(), MailboxError> {
    kv_delete(conn, &enc_rejected_kv(host))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    mod trust;

    #[test]
    fn http_dates_parse_and_others_do_not() {
        assert_eq!(
            parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(784_111_777_000)
        );
        assert_eq!(parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(
            parse_http_date("Wed, 31 Dec 2025 23:59:59 GMT"),
            Some(1_767_225_599_000)
        );
        for bad in [
            "",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Foo 1994 08:49:37 GMT",
            "Sun, 6 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 25:49:37 GMT",
        ] {
            assert_eq!(parse_http_date(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn refusals_are_classified_by_the_relay_date_at_the_hop_window() {
        let relay_now = 784_111_777_000;
        let date = "Sun, 06 Nov 1994 08:49:37 GMT";
        // At the window: clocks agree.
        let (s, _, off) = classify_refusal(Some(date), relay_now + HOP_WINDOW_MS);
        assert_eq!((s, off), (Standing::RefusedAfterEnrol, Some(HOP_WINDOW_MS)));
        let (s, _, _) = classify_refusal(Some(date), relay_now - HOP_WINDOW_MS);
        assert_eq!(s, Standing::RefusedAfterEnrol);
        // Past it, either way: clock skew, with the direction.
        let (s, d, _) = classify_refusal(Some(date), relay_now + HOP_WINDOW_MS + 1);
        assert_eq!(s, Standing::ClockSkew);
        assert!(d.contains("ahead of"), "{d}");
        let (s, d, _) = classify_refusal(Some(date), relay_now - 600_000);
        assert_eq!(s, Standing::ClockSkew);
        assert!(d.contains("10 min behind"), "{d}");
        // No usable Date: reported as likely skew.
        assert_eq!(classify_refusal(None, 0).0, Standing::ClockSkew);
        assert_eq!(
            classify_refusal(Some("yesterday"), 0).0,
            Standing::ClockSkew
        );
    }

    #[test]
    fn the_backoff_doubles_from_one_minute_to_one_hour() {
        let delays: Vec<i64> = (1..=9).map(backoff_delay_ms).collect();
        assert_eq!(
            delays,
            vec![
                60_000, 120_000, 240_000, 480_000, 960_000, 1_920_000, 3_600_000, 3_600_000,
                3_600_000
            ]
        );
        assert_eq!(backoff_delay_ms(u32::MAX), ENROL_BACKOFF_MAX_MS);
        let store = crate::testutil::store();
        store
            .mailbox
            .with(|c| {
                assert_eq!(
                    bump_backoff(c, "http://r", 0)?,
                    Backoff {
                        n: 1,
                        next_at: 60_000
                    }
                );
                assert_eq!(
                    bump_backoff(c, "http://r/", 10)?,
                    Backoff {
                        n: 2,
                        next_at: 120_010
                    }
                );
                assert!(clear_backoff(c, "http://r")?);
                assert_eq!(backoff(c, "http://r")?, None);
                Ok(())
            })
            .unwrap();
    }

    /// Case `clock-fix-does-not-release-mail`: a refusal pause started while the clock was
    /// 10 min ahead (e.g. the relay refused the skewed hops) is over once the clock is right;
    /// one started at the right clock holds for its whole delay.
    #[test]
    fn a_pause_begun_under_a_clock_ahead_is_over_once_the_clock_is_right() {
        const T: i64 = 1_767_225_660_000;
        let store = crate::testutil::store();
        store
            .mailbox
            .with(|c| {
                let skewed = bump_backoff(c, "http://r", T + 600_000)?;
                assert!(skewed.holds_at(T + 600_000));
                assert!(!skewed.holds_at(T));
                let right = bump_backoff(c, "http://r", T)?;
                assert_eq!(right.n, 2);
                assert!(right.holds_at(T));
                assert!(right.holds_at(T + backoff_delay_ms(2) - 1));
                assert!(!right.holds_at(T + backoff_delay_ms(2)));
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_key_mismatch_is_audited_once_per_served_key_and_kept_until_confirmed() {
        let store = crate::testutil::store();
        let url = "http://relay:1";
        let events =
            |c: &Connection| audit::recent(c, Some("relay.key_changed"), 100).map(|v| v.len());
        store
            .mailbox
            .with(|c| {
                assert!(record_key_mismatch(c, url, "pinned", "aaaa", "bbbb", 1)?);
                assert!(!record_key_mismatch(c, url, "pinned", "aaaa", "bbbb", 2)?);
                assert_eq!(events(c)?, 1);
                let st = state(c, url)?.unwrap();
                assert_eq!(st.state, Standing::KeyMismatch);
                assert_eq!(st.at, iso_ms(1), "the episode keeps its start");
                assert_eq!(
                    st.fix(url).unwrap(),
                    "agentmbx relay set http://relay:1 --key bbbb"
                );
                // Unreachable does not hide it.
                assert!(!note_state(
                    c,
                    url,
                    RelayState::new(Standing::Unreachable),
                    3
                )?);
                assert_eq!(state(c, url)?.unwrap().state, Standing::KeyMismatch);
                // Another served key is a new event.
                assert!(record_key_mismatch(c, url, "pinned", "aaaa", "cccc", 4)?);
                assert_eq!(events(c)?, 2);
                // The owner confirms: pinned, state cleared, audited.
                let k = agentmbx_protocol::keys::HostKey::generate().public();
                let done = confirm_key(c, url, Some(&k), None, 5)?;
                assert!(done.changed);
                assert_eq!(state(c, url)?, None);
                assert_eq!(kv_get(c, &key_kv(url))?, Some(k.to_b64()));
                let confirmed = audit::recent(c, Some("relay.key_confirmed"), 10)?;
                assert_eq!(confirmed.len(), 1);
                assert_eq!(confirmed[0].detail["to"], k.fingerprint());
                // Confirming the same key again changes nothing.
                assert!(!confirm_key(c, url, Some(&k), None, 6)?.changed);
                assert_eq!(audit::recent(c, Some("relay.key_confirmed"), 10)?.len(), 1);
                // An expectation (relay unreachable) drops the pin.
                confirm_key(c, url, None, Some("1111-2222-3333-4444"), 7)?;
                assert_eq!(kv_get(c, &key_kv(url))?, None);
                assert_eq!(
                    kv_get(c, &expect_kv(url))?.as_deref(),
                    Some("1111-2222-3333-4444")
                );
                let last = &audit::recent(c, Some("relay.key_confirmed"), 1)?[0];
                assert_eq!(last.detail["pending"], true);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn the_rollback_guard_is_per_peer_host_key() {
        let store = crate::testutil::store();
        let k1 = agentmbx_protocol::keys::EncKey::generate()
            .public()
            .to_b64();
        let k2 = agentmbx_protocol::keys::EncKey::generate()
            .public()
            .to_b64();
        store
            .mailbox
            .with(|c| {
                assert_eq!(guard_enc_ad(c, "peerA", &k1, 100)?, Ok(()));
                // Not newer, another key: refused with the reason.
                let why = guard_enc_ad(c, "peerA", &k2, 100)?.unwrap_err();
                assert!(why.starts_with("rolled back: "), "{why}");
                assert!(guard_enc_ad(c, "peerA", &k2, 99)?.is_err());
                // Older, same key: fine, the newest stays.
                assert_eq!(guard_enc_ad(c, "peerA", &k1, 50)?, Ok(()));
                assert!(guard_enc_ad(c, "peerA", &k2, 100)?.is_err());
                // Another peer key has its own guard.
                assert_eq!(guard_enc_ad(c, "peerB", &k2, 1)?, Ok(()));
                // Newer with another key: accepted, and now the old key is the rollback.
                assert_eq!(guard_enc_ad(c, "peerA", &k2, 101)?, Ok(()));
                assert!(guard_enc_ad(c, "peerA", &k1, 101)?.is_err());
                Ok(())
            })
            .unwrap();
    }
}
