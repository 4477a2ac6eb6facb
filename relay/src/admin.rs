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
//! Every change is one store transaction and is recorded in the relay log (`relay-revoke`,
//! `relay-deny`, `relay-undeny` receipts). A revoked or denied host's next request is refused:
//! every hop reads the enrolment and the deny-list from the store.
//!
//! Every function here **blocks** (store calls); the endpoint runs them off the runtime.

use serde::Serialize;
use serde_json::json;

use agentmbx_protocol::keys::PublicKey;

use crate::store::{
    DenyEntry, DenyKind, DenyOutcome, Enrolment, OpenOptions, RelayStore, RevokeOutcome,
    SqliteStore, StoreError, LOCK_FILE,
};

/// Opens the store in `dir` for an offline operator command: bound to the relay key its
/// `relay.db` records (the relay's private key is not needed), `relay.lock` taken without
/// waiting. Errors: [`AdminError::NoStore`], [`AdminError::Running`] while `serve` (or another
/// command) holds the lock, store errors (a newer schema…).
pub fn open_offline(dir: &std::path::Path, now_ms: i64) -> Result<SqliteStore, AdminError> {
    let Some(relay_pubkey) = SqliteStore::recorded_relay_pubkey(dir)? else {
        return Err(AdminError::NoStore(dir.to_path_buf()));
    };
    let options = OpenOptions {
        lock_wait_ms: 0,
        ..OpenOptions::default()
    };
    match SqliteStore::open_with(dir, &relay_pubkey, now_ms, options) {
        Ok(store) => Ok(store),
        Err(StoreError::Locked { .. }) => Err(AdminError::Running(dir.join(LOCK_FILE))),
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
    let host = HostRef::parse(target).ok_or_else(|| {
        AdminError::Invalid(format!(
            "{target:?} is neither a host key (base64) nor a fingerprint (16 hex digits)"
        ))
    })?;
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
    let outcome = store.revoke(&key, now_ms)?;
    if outcome == RevokeOutcome::Unknown {
        return Err(AdminError::NotFound(host.fingerprint()));
    }
    let enrolment = store
        .enrolment(&key)?
        .ok_or_else(|| AdminError::NotFound(host.fingerprint()))?;
    let summary = HostSummary::from(&enrolment);
    if outcome == RevokeOutcome::Revoked {
        store.append_op(
            now_ms,
            "relay-revoke",
            &json!({"v": 1, "type": "relay-revoke", "host_pubkey": summary.host_pubkey,
                    "fingerprint": summary.fingerprint, "host_name": summary.host_name,
                    "at": agentmbx_protocol::time::iso_ms(now_ms)}),
        )?;
        tracing::warn!(host_fingerprint = %summary.fingerprint, host = %summary.host_name, "host key revoked");
    }
    Ok(RevokeReport {
        host: summary,
        newly_revoked: outcome == RevokeOutcome::Revoked,
    })
}

/// What a deny-list argument names: a host (by fingerprint, or by key turned into its
/// fingerprint) or a client_id. `kind` forces the reading; without it a fingerprint or a host
/// key is a host and anything else a client_id.
pub fn deny_target(text: &str, kind: Option<DenyKind>) -> Result<(DenyKind, String), AdminError> {
    let text = text.trim();
    let as_host = || HostRef::parse(text).map(|h| h.fingerprint());
    match kind {
        Some(DenyKind::Host) => as_host().map(|fp| (DenyKind::Host, fp)).ok_or_else(|| {
            AdminError::Invalid(format!(
                "{text:?} is neither a host fingerprint nor a host key"
            ))
        }),
        Some(DenyKind::Client) => client_id(text).map(|c| (DenyKind::Client, c)),
        None => match as_host() {
            Some(fp) => Ok((DenyKind::Host, fp)),
            None => client_id(text).map(|c| (DenyKind::Client, c)),
        },
    }
}

fn client_id(text: &str) -> Result<String, AdminError> {
    if text.is_empty() || text.len() > 256 || text.chars().any(char::is_control) {
        return Err(AdminError::Invalid(
            "a client_id must be 1..=256 bytes without control characters".to_owned(),
        ));
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
    let entry = DenyEntry {
        kind,
        value,
        until_ms,
        at_ms: now_ms,
    };
    match store.deny(entry)? {
        DenyOutcome::Full => Err(AdminError::Full),
        DenyOutcome::Stored(e) => {
            store.append_op(
                now_ms,
                "relay-deny",
                &json!({"v": 1, "type": "relay-deny", "kind": e.kind.as_str(), "value": e.value,
                        "until": e.until_ms.map(agentmbx_protocol::time::iso_ms),
                        "at": agentmbx_protocol::time::iso_ms(now_ms)}),
            )?;
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
    let removed = store.undeny(kind, &value)?;
    if removed {
        store.append_op(
            now_ms,
            "relay-undeny",
            &json!({"v": 1, "type": "relay-undeny", "kind": kind.as_str(), "value": value,
                    "at": agentmbx_protocol::time::iso_ms(now_ms)}),
        )?;
    }
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
mod tests {
    use super::*;

    #[test]
    fn fingerprints_and_targets_parse() {
        assert_eq!(
            parse_fingerprint("ABCD:EF01 2345-6789").as_deref(),
            Some("abcd-ef01-2345-6789")
        );
        assert_eq!(parse_fingerprint("abcd-ef01-2345-678"), None);
        let key = agentmbx_protocol::keys::HostKey::generate().public();
        assert_eq!(
            deny_target(&key.to_b64(), None).expect("key"),
            (DenyKind::Host, key.fingerprint())
        );
        assert_eq!(
            deny_target("abcdef0123456789", None).expect("fp"),
            (DenyKind::Host, "abcd-ef01-2345-6789".to_owned())
        );
        assert_eq!(
            deny_target("cli-42", None).expect("client"),
            (DenyKind::Client, "cli-42".to_owned())
        );
        // Forced readings.
        assert_eq!(
            deny_target("abcdef0123456789", Some(DenyKind::Client)).expect("client"),
            (DenyKind::Client, "abcdef0123456789".to_owned())
        );
        assert!(deny_target("cli-42", Some(DenyKind::Host)).is_err());
        assert!(deny_target("", None).is_err());
        assert!(deny_target(&"c".repeat(257), None).is_err());
        assert!(deny_target("a\nb", None).is_err());
        deny_target(&"c".repeat(256), None).expect("at the bound");
    }

    #[test]
    fn until_takes_durations_and_utc_times() {
        let now = 1_767_225_600_000;
        for (text, want) in [
            ("90s", now + 90_000),
            ("30m", now + 1_800_000),
            ("2h", now + 7_200_000),
            ("7d", now + 604_800_000),
            ("1w", now + 604_800_000),
            ("2026-01-31T12:00:00Z", 1_769_860_800_000),
            ("2026-01-31T12:00:00.500Z", 1_769_860_800_500),
        ] {
            assert_eq!(parse_until(text, now).expect(text), want, "{text}");
        }
        for bad in [
            "",
            "2",
            "h",
            "0h",
            "2y",
            "-2h",
            "2026-01-31",
            "tomorrow",
            "99999999999999d",
        ] {
            assert!(parse_until(bad, now).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_fingerprint_of_several_enrolments_is_refused_with_the_list() {
        use crate::store::{AuthorityStrength, EnrolRequest};
        let dir = tempfile::tempdir().expect("tempdir");
        let relay = agentmbx_protocol::keys::HostKey::generate()
            .public()
            .to_b64();
        let key = agentmbx_protocol::keys::HostKey::generate().public();
        let store = SqliteStore::open(dir.path(), &relay, 1).expect("open");
        store
            .enrol(EnrolRequest {
                host_pubkey: key.to_b64(),
                host_name: "one".into(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".into(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: 1,
            })
            .expect("enrol");
        store.close().expect("close");
        // A second row whose text differs but names the same key bytes (only a corrupted or
        // hand-edited store can hold one): the fingerprint matches both.
        {
            let conn =
                rusqlite::Connection::open(dir.path().join(crate::store::DB_FILE)).expect("raw");
            conn.execute(
                "INSERT INTO enrolments (host_pubkey, host_name, owner_fp, account, authorized_by,
                   authority_rank, enrolled_at, revoked_at)
                 VALUES (?1, 'two', '', NULL, 'host-key-challenge', 0, 2, NULL)",
                [format!("{}\n", key.to_b64())],
            )
            .expect("insert");
        }
        let store = open_offline(dir.path(), 3).expect("offline");
        match revoke(&store, &key.fingerprint(), 3) {
            Err(e @ AdminError::Ambiguous { .. }) => {
                let text = e.to_string();
                assert!(text.contains("matches 2 enrolments"), "{text}");
                assert!(text.contains("(one)") && text.contains("(two)"), "{text}");
            }
            other => panic!("{other:?}"),
        }
        // Nothing was revoked; by key it works.
        assert!(!store
            .enrolment(&key.to_b64())
            .expect("read")
            .expect("row")
            .is_revoked());
        let r = revoke(&store, &key.to_b64(), 4).expect("by key");
        assert!(r.newly_revoked);
        assert_eq!(r.host.host_name, "one");
        // A second offline open is refused while this one holds the lock.
        assert!(matches!(
            open_offline(dir.path(), 5),
            Err(AdminError::Running(_))
        ));
        assert!(matches!(
            open_offline(&dir.path().join("none"), 5),
            Err(AdminError::NoStore(_))
        ));
    }
}
