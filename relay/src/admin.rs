//! Operator controls over enrolments (spec §8 "Revocation"; design README "One process writes
//! a store"): `relay revoke` and `relay deny`, one implementation for both ways of running them —
//! offline on `--store-dir` (the CLI opens the store, which refuses while `serve` holds
//! `relay.lock`) and through a running relay's admin endpoint (`handlers/admin.rs`).
//!
//! - **Revoke** (permanent): a host key, given as its base64 key or its fingerprint, is revoked
//!   for good (re-enrolment never clears it). A fingerprint that matches several enrolments is
//!   refused with the list ([`AdminError::Ambiguous`]).
//! - **Deny** (deny-list): a host fingerprint or a token `client_id`, optionally until a time.
//!   A temporary entry must last at least [`MIN_DENY_MS`] — the longest account-token lifetime —
//!   so a token minted before the entry cannot outlive it (`wire.md` "Account tokens"). Removal
//!   and listing too.
//!
//! Every change and its relay-log receipt (`relay-revoke`, `relay-deny`, `relay-undeny`) are one
//! store transaction
//! ([`DirectoryStore::revoke_logged`](crate::store::DirectoryStore::revoke_logged),
//! [`DirectoryStore::deny_logged`](crate::store::DirectoryStore::deny_logged),
//! [`DirectoryStore::undeny_logged`](crate::store::DirectoryStore::undeny_logged)): never a change
//! without its receipt or the reverse. A revoked or denied host's next request is refused: every
//! hop reads the enrolment and the deny-list from the store.
//!
//! Every function here **blocks** (store calls); the endpoint runs them off the runtime.

use serde::Serialize;
use serde_json::json;

use agentmbx_protocol::keys::PublicKey;

use crate::store::{
    DenyEntry, DenyKind, DenyOutcome, Enrolment, OpEntry, RelayStore, RevokeOutcome, SqliteStore,
    StoreError, LOCK_FILE,
};

/// A store [`open_offline`] opened for one operator command.
pub struct OfflineStore {
    /// The store, its `relay.lock` held.
    pub store: SqliteStore,
    /// `None` when the relay key signs every relay-log receipt the command appends; else the
    /// operator's warning that they are unsigned, and why
    /// ([`crate::ops::unsigned_receipt_reason`]).
    pub unsigned: Option<String>,
}

impl std::fmt::Debug for OfflineStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OfflineStore")
            .field("store", &self.store)
            .field("unsigned", &self.unsigned.is_some())
            .finish()
    }
}

/// Opens the store in `dir` for an offline operator command: `relay.lock` taken without
/// waiting, signing its relay-log receipts with the relay key
/// ([`crate::ops::offline_relay_key_if_any`]: `MBX_RELAY_KEY` or `relay.key` in `dir`), which
/// must be the one its `relay.db` records. With neither, the store is opened bound to the key
/// it records and the receipts are appended unsigned ([`OfflineStore::unsigned`] says so): an
/// emergency revocation on a relay whose key lives only in a platform secret is never blocked
/// (`relay log` marks such receipts NOT VERIFIED). Errors: [`AdminError::NoStore`],
/// [`AdminError::RelayKey`] (a malformed key), [`AdminError::Running`] while `serve` (or
/// another command) holds the lock, store errors (a newer schema, another relay's key…).
pub fn open_offline(dir: &std::path::Path, now_ms: i64) -> Result<OfflineStore, AdminError> {
    let Some(recorded) = SqliteStore::recorded_relay_pubkey(dir)? else {
        return Err(AdminError::NoStore(dir.to_path_buf()));
    };
    let key = crate::ops::offline_relay_key_if_any(dir)
        .map_err(|e| AdminError::RelayKey(e.to_string()))?;
    let (opened, unsigned) = match key {
        Some(key) => (crate::ops::open_offline_signed(dir, key, now_ms), None),
        None => {
            let options = crate::store::OpenOptions {
                lock_wait_ms: 0,
                ..crate::store::OpenOptions::default()
            };
            (
                SqliteStore::open_with(dir, &recorded, now_ms, options),
                Some(crate::ops::unsigned_receipt_reason(dir)),
            )
        }
    };
    match opened {
        Ok(store) => Ok(OfflineStore { store, unsigned }),
        Err(StoreError::Locked { .. }) => Err(AdminError::Running(dir.join(LOCK_FILE))),
        // A relay may run on it without relay.lock: exit 4 like a held lock, with its own text.
        Err(e @ StoreError::LiveHeartbeat { .. }) => Err(AdminError::Store(e)),
        Err(e) => Err(e.into()),
    }
}

/// Shortest temporary deny entry (ms): the longest account-token lifetime, 15 minutes.
pub const MIN_DENY_MS: i64 = 900_000;

/// Why an operator command changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The argument is not usable (the text says why; it never holds secrets).
    #[error("{0}")]
    Invalid(String),
    /// No enrolment has this key or fingerprint.
    #[error("no enrolment matches {0}")]
    NotFound(String),
    /// A fingerprint matches several enrolments: name the key instead.
    #[error("{fingerprint} matches {} enrolments; revoke one of them by its key: {}", .matches.len(), .matches.iter().map(|m| format!("{} ({})", m.host_pubkey, m.host_name)).collect::<Vec<_>>().join(", "))]
    Ambiguous {
        /// The fingerprint given.
        fingerprint: String,
        /// The enrolments it matches.
        matches: Vec<HostSummary>,
    },
    /// The deny-list holds its maximum of entries.
    #[error(
        "the deny-list is full ({} entries); remove some first",
        crate::store::MAX_DENY_ENTRIES
    )]
    Full,
    /// The directory holds no relay store.
    #[error("{} holds no relay store (relay.db)", .0.display())]
    NoStore(std::path::PathBuf),
    /// A running relay (`relay serve`) holds the store's lock: use its admin endpoint
    /// (`--url`) or stop it first.
    #[error("a running relay holds {}: stop it first, or run this through its admin endpoint (--url <relay url> with the admin token)", .0.display())]
    Running(std::path::PathBuf),
    /// The relay key that signs the relay-log receipt is missing or malformed.
    #[error("{0}")]
    RelayKey(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// One enrolment as operators see it (`--json` output, ambiguity lists).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostSummary {
    /// The host key (base64).
    pub host_pubkey: String,
    /// Its fingerprint.
    pub fingerprint: String,
    /// The enrolled name.
    pub host_name: String,
    /// The proven account, if any.
    pub account: Option<String>,
    /// When it was revoked (ms), if it is.
    pub revoked_at_ms: Option<i64>,
}

impl From<&Enrolment> for HostSummary {
    fn from(e: &Enrolment) -> Self {
        HostSummary {
            fingerprint: PublicKey::from_b64(&e.host_pubkey)
                .map(|k| k.fingerprint())
                .unwrap_or_default(),
            host_pubkey: e.host_pubkey.clone(),
            host_name: e.host_name.clone(),
            account: e.account.clone(),
            revoked_at_ms: e.revoked_at_ms,
        }
    }
}

/// The result of [`revoke`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RevokeReport {
    /// The host revoked (its state after the command).
    pub host: HostSummary,
    /// `false` when it was already revoked (its original time is kept).
    pub newly_revoked: bool,
}

/// Normalises a fingerprint: 16 hex digits, any case, dashes, colons or spaces optional →
/// `xxxx-xxxx-xxxx-xxxx`; `None` otherwise.
pub fn parse_fingerprint(text: &str) -> Option<String> {
    let hex: String = text
        .trim()
        .chars()
        .filter(|c| !matches!(c, '-' | ':' | ' '))
        .collect::<String>()
        .to_ascii_lowercase();
    (hex.len() == 16 && hex.chars().all(|c| c.is_ascii_hexdigit())).then(|| {
        format!(
            "{}-{}-{}-{}",
            &hex[0..4],
            &hex[4..8],
            &hex[8..12],
            &hex[12..16]
        )
    })
}

/// A host named by its key (canonical base64) or fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRef {
    /// A key, in canonical text.
    Key(String),
    /// A fingerprint `xxxx-xxxx-xxxx-xxxx`.
    Fingerprint(String),
}

impl HostRef {
    /// Parses a host key (base64) or a fingerprint; `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        if let Ok(k) = PublicKey::from_b64(text.trim()) {
            return Some(HostRef::Key(k.to_b64()));
        }
        parse_fingerprint(text).map(HostRef::Fingerprint)
    }

    /// The fingerprint of the host.
    pub fn fingerprint(&self) -> String {
        match self {
            HostRef::Key(k) => PublicKey::from_b64(k)
                .map(|k| k.fingerprint())
                .unwrap_or_default(),
            HostRef::Fingerprint(fp) => fp.clone(),
        }
    }
}

/// Revokes the host `target` (a key or fingerprint, [`HostRef::parse`]) at `now_ms` and logs a
/// `relay-revoke` receipt. Errors: [`AdminError::Invalid`] (neither key nor fingerprint),
/// [`AdminError::NotFound`], [`AdminError::Ambiguous`], store errors.
pub fn revoke(
    store: &dyn RelayStore,
    target: &str,
    now_ms: i64,
) -> Result<RevokeReport, AdminError> {
    let host = revoke_target(target)?;
    let key = match &host {
        HostRef::Key(k) => k.clone(),
        HostRef::Fingerprint(fp) => {
            let found = store.enrolments_by_fingerprint(fp)?;
            match found.as_slice() {
                [] => return Err(AdminError::NotFound(fp.clone())),
                [one] => one.host_pubkey.clone(),
                many => {
                    return Err(AdminError::Ambiguous {
                        fingerprint: fp.clone(),
                        matches: many.iter().map(HostSummary::from).collect(),
                    })
                }
            }
        }
    };
    let before = store
        .enrolment(&key)?
        .ok_or_else(|| AdminError::NotFound(host.fingerprint()))?;
    let named = HostSummary::from(&before);
    let log = OpEntry {
        at_ms: now_ms,
        op: "relay-revoke".to_owned(),
        receipt: json!({"v": 1, "type": "relay-revoke", "host_pubkey": named.host_pubkey,
                        "fingerprint": named.fingerprint, "host_name": named.host_name,
                        "at": agentmbx_protocol::time::iso_ms(now_ms)}),
    };
    let outcome = store.revoke_logged(&key, now_ms, log)?;
    if outcome == RevokeOutcome::Unknown {
        return Err(AdminError::NotFound(host.fingerprint()));
    }
    let enrolment = store
        .enrolment(&key)?
        .ok_or_else(|| AdminError::NotFound(host.fingerprint()))?;
    let summary = HostSummary::from(&enrolment);
    if outcome == RevokeOutcome::Revoked {
        tracing::warn!(host_fingerprint = %summary.fingerprint, host = %summary.host_name, "host key revoked");
    }
    Ok(RevokeReport {
        host: summary,
        newly_revoked: outcome == RevokeOutcome::Revoked,
    })
}

/// Longest client_id accepted (characters, all printable ASCII).
pub const MAX_CLIENT_ID_CHARS: usize = 256;
/// Most characters of an operator's argument an error message echoes.
pub const MAX_ECHOED_CHARS: usize = 64;

/// `text` for an error message: its first [`MAX_ECHOED_CHARS`] characters in quotes, every
/// character outside printable ASCII (control, bidi and other format characters, any
/// non-ASCII) escaped as `\u{…}`, `...` when cut.
pub fn shown(text: &str) -> String {
    let mut out = String::from("\"");
    for (i, c) in text.chars().enumerate() {
        if i == MAX_ECHOED_CHARS {
            out.push_str("...");
            break;
        }
        out.extend(c.escape_default());
    }
    out.push('"');
    out
}

/// The host `relay revoke` names: a host key (base64) or a fingerprint ([`HostRef::parse`]).
/// Errors: [`AdminError::Invalid`], echoing at most [`MAX_ECHOED_CHARS`] of `text`, escaped.
pub fn revoke_target(text: &str) -> Result<HostRef, AdminError> {
    HostRef::parse(text).ok_or_else(|| {
        AdminError::Invalid(format!(
            "{} is neither a host key (base64) nor a fingerprint (16 hex digits)",
            shown(text)
        ))
    })
}

/// What a deny-list argument names: a host (by fingerprint, or by key turned into its
/// fingerprint) or a client_id. `kind` forces the reading; without it a fingerprint or a host
/// key is a host, text that looks like a mistyped fingerprint (only hex digits, dashes, colons
/// and spaces, but not 16 hex digits) is refused ("not a fingerprint; use --client …"), and
/// anything else is a client_id: 1..=[`MAX_CLIENT_ID_CHARS`] printable ASCII characters
/// (OAuth's `client_id` alphabet, RFC 6749 Appendix A.1; no control, bidi or other format
/// characters). Errors: [`AdminError::Invalid`], echoing at most [`MAX_ECHOED_CHARS`] of
/// `text`, escaped.
pub fn deny_target(text: &str, kind: Option<DenyKind>) -> Result<(DenyKind, String), AdminError> {
    let text = text.trim();
    let as_host = || HostRef::parse(text).map(|h| h.fingerprint());
    match kind {
        Some(DenyKind::Host) => as_host().map(|fp| (DenyKind::Host, fp)).ok_or_else(|| {
            AdminError::Invalid(format!(
                "{} is neither a host fingerprint nor a host key",
                shown(text)
            ))
        }),
        Some(DenyKind::Client) => client_id(text).map(|c| (DenyKind::Client, c)),
        None => match as_host() {
            Some(fp) => Ok((DenyKind::Host, fp)),
            None if looks_like_fingerprint(text) => Err(AdminError::Invalid(format!(
                "{} is not a fingerprint (16 hex digits, such as 1a2b-3c4d-5e6f-7a8b); use --client to deny a client_id of that form",
                shown(text)
            ))),
            None => client_id(text).map(|c| (DenyKind::Client, c)),
        },
    }
}

/// Only hex digits, dashes, colons and spaces, with at least one hex digit: what a fingerprint
/// is written with ([`parse_fingerprint`] already refused it as one).
fn looks_like_fingerprint(text: &str) -> bool {
    text.chars().any(|c| c.is_ascii_hexdigit())
        && text
            .chars()
            .all(|c| c.is_ascii_hexdigit() || matches!(c, '-' | ':' | ' '))
}

fn client_id(text: &str) -> Result<String, AdminError> {
    let printable = text.chars().all(|c| (' '..='~').contains(&c));
    if text.is_empty() || text.chars().count() > MAX_CLIENT_ID_CHARS || !printable {
        return Err(AdminError::Invalid(format!(
            "a client_id must be 1..={MAX_CLIENT_ID_CHARS} printable ASCII characters (no control, bidi or other format characters), got {}",
            shown(text)
        )));
    }
    Ok(text.to_owned())
}

/// Adds (or replaces) a deny-list entry for `target` ([`deny_target`]) until `until_ms` (`None`:
/// until removed) and logs a `relay-deny` receipt. Errors: [`AdminError::Invalid`] (a bad
/// target, or an `until` less than [`MIN_DENY_MS`] ahead of `now_ms`), [`AdminError::Full`],
/// store errors.
pub fn deny(
    store: &dyn RelayStore,
    target: &str,
    kind: Option<DenyKind>,
    until_ms: Option<i64>,
    now_ms: i64,
) -> Result<DenyEntry, AdminError> {
    let (kind, value) = deny_target(target, kind)?;
    if let Some(until) = until_ms {
        if until.saturating_sub(now_ms) < MIN_DENY_MS {
            return Err(AdminError::Invalid(format!(
                "a deny entry must last at least {} min (the longest account-token lifetime); use `relay revoke` to revoke for good",
                MIN_DENY_MS / 60_000
            )));
        }
    }
    let log = OpEntry {
        at_ms: now_ms,
        op: "relay-deny".to_owned(),
        receipt: json!({"v": 1, "type": "relay-deny", "kind": kind.as_str(), "value": value,
                        "until": until_ms.map(agentmbx_protocol::time::iso_ms),
                        "at": agentmbx_protocol::time::iso_ms(now_ms)}),
    };
    let entry = DenyEntry {
        kind,
        value,
        until_ms,
        at_ms: now_ms,
    };
    match store.deny_logged(entry, log)? {
        DenyOutcome::Full => Err(AdminError::Full),
        DenyOutcome::Stored(e) => {
            tracing::warn!(kind = e.kind.as_str(), value = %e.value, until_ms = ?e.until_ms, "deny-list entry added");
            Ok(e)
        }
    }
}

/// Removes the deny-list entry for `target` ([`deny_target`]); `false` when there was none.
pub fn undeny(
    store: &dyn RelayStore,
    target: &str,
    kind: Option<DenyKind>,
    now_ms: i64,
) -> Result<(DenyKind, String, bool), AdminError> {
    let (kind, value) = deny_target(target, kind)?;
    let log = OpEntry {
        at_ms: now_ms,
        op: "relay-undeny".to_owned(),
        receipt: json!({"v": 1, "type": "relay-undeny", "kind": kind.as_str(), "value": value,
                        "at": agentmbx_protocol::time::iso_ms(now_ms)}),
    };
    let removed = store.undeny_logged(kind, &value, log)?;
    Ok((kind, value, removed))
}

/// A deny-list entry as operators see it (`--json`, the admin endpoint).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DenyView {
    /// `host` or `client`.
    pub kind: &'static str,
    /// The fingerprint or client_id.
    pub value: String,
    /// ISO ms end, `None` for "until removed".
    pub until: Option<String>,
    /// ISO ms of the last write.
    pub at: String,
    /// Whether it denies now.
    pub active: bool,
}

impl DenyView {
    /// The view of `e` at `now_ms`.
    pub fn of(e: &DenyEntry, now_ms: i64) -> Self {
        DenyView {
            kind: e.kind.as_str(),
            value: e.value.clone(),
            until: e.until_ms.map(agentmbx_protocol::time::iso_ms),
            at: agentmbx_protocol::time::iso_ms(e.at_ms),
            active: e.is_active(now_ms),
        }
    }
}

/// Every deny-list entry, as [`DenyView`]s at `now_ms`.
pub fn deny_list(store: &dyn RelayStore, now_ms: i64) -> Result<Vec<DenyView>, AdminError> {
    Ok(store
        .deny_entries()?
        .iter()
        .map(|e| DenyView::of(e, now_ms))
        .collect())
}

/// Parses `--until`: a duration from `now_ms` (`90s`, `30m`, `2h`, `7d`, `1w`; a positive
/// integer and one unit) or an ISO time (`YYYY-MM-DDTHH:MM:SS[.mmm]Z`). Errors name the accepted
/// forms.
pub fn parse_until(text: &str, now_ms: i64) -> Result<i64, AdminError> {
    let t = text.trim();
    let bad = || {
        AdminError::Invalid(format!(
            "--until {t:?}: give a duration (90s, 30m, 2h, 7d, 1w) or a UTC time (2026-01-31T12:00:00Z)"
        ))
    };
    if let Some(unit) = t.chars().last().filter(|c| c.is_ascii_alphabetic()) {
        let digits = &t[..t.len() - 1];
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && digits.len() <= 12 {
            let n: i64 = digits.parse().map_err(|_| bad())?;
            let unit_ms = match unit {
                's' => 1_000,
                'm' => 60_000,
                'h' => 3_600_000,
                'd' => 86_400_000,
                'w' => 604_800_000,
                _ => return Err(bad()),
            };
            return n
                .checked_mul(unit_ms)
                .and_then(|d| now_ms.checked_add(d))
                .filter(|_| n > 0)
                .ok_or_else(bad);
        }
    }
    let iso = if t.len() == 20 && t.ends_with('Z') {
        format!("{}.000Z", &t[..19])
    } else {
        t.to_owned()
    };
    agentmbx_protocol::time::parse_iso_ms(&iso).ok_or_else(bad)
}

#[cfg(test)]
mod tests;
