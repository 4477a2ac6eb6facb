//! Enrolments, revocation, enc-key advertisements and sender allowlists (spec §2, `wire.md`
//! §3.2 "Enrolment").

use std::collections::HashSet;

use rusqlite::{params, Connection, OptionalExtension};

use super::enrolment_rows::{
    enrol_apply, enrolment_from_row, enrolment_row, live_enrolment_count, revoke_apply,
    ENROLMENT_COLS,
};
use super::writer::JobKind;
use super::{deny, rotate, SqliteStore};
use crate::store::{
    is_canonical_key, DirectoryStore, EncAd, EncAdV1, EncAdV2, EnrolOutcome, EnrolRequest,
    Enrolment, RevokeOutcome, SenderList, SenderListOutcome, StoreError,
};

// ---------------------------------------------------------------------------------------------
// Enc-key advertisements

fn get_enc_ad(c: &Connection, host_pubkey: &str) -> Result<Option<EncAd>, StoreError> {
    type Row = (
        String,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i64>,
    );
    let row: Option<Row> = c
        .prepare_cached(
            "SELECT e.host_name,
                    a.host_name, a.enc_pub, a.sig, a.at,
                    r.enc_pub, r.record, r.sig, r.at
             FROM enrolments e
             LEFT JOIN enc_ads a ON a.host_pubkey = e.host_pubkey
             LEFT JOIN enc_ad_records r ON r.host_pubkey = e.host_pubkey
             WHERE e.host_pubkey = ?1 AND e.revoked_at IS NULL",
        )?
        .query_row([host_pubkey], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
                r.get(6)?,
                r.get(7)?,
                r.get(8)?,
            ))
        })
        .optional()?;
    let Some((host_name, v1_name, v1_pub, v1_sig, v1_at, v2_pub, v2_record, v2_sig, v2_at)) = row
    else {
        return Ok(None);
    };
    let v2 = match (v2_pub, v2_record, v2_sig, v2_at) {
        (Some(enc_pub), Some(record), Some(sig), Some(at_ms)) => Some(EncAdV2 {
            host_pubkey: host_pubkey.to_owned(),
            enc_pub,
            record,
            sig,
            at_ms,
        }),
        _ => None,
    };
    let v1 = match (v1_name, v1_pub, v1_sig, v1_at) {
        (Some(host_name), Some(enc_pub), Some(sig), Some(at_ms)) => Some(EncAdV1 {
            host_pubkey: host_pubkey.to_owned(),
            host_name,
            enc_pub,
            sig,
            at_ms,
        }),
        _ => None,
    };
    // A served enc_pub always equals the v2 record's: a v1 ad naming another key is not served.
    let v1 = v1.filter(|a| v2.as_ref().is_none_or(|r| r.enc_pub == a.enc_pub));
    let enc_pub = match (&v2, &v1) {
        (Some(r), _) => r.enc_pub.clone(),
        (None, Some(a)) => a.enc_pub.clone(),
        (None, None) => return Ok(None),
    };
    Ok(Some(EncAd {
        host_pubkey: host_pubkey.to_owned(),
        host_name,
        enc_pub,
        v1,
        v2,
    }))
}

// ---------------------------------------------------------------------------------------------
// Sender lists

fn put_sender_list(c: &Connection, list: SenderList) -> Result<SenderListOutcome, StoreError> {
    let stored_iat: Option<i64> = c
        .prepare_cached("SELECT iat FROM sender_lists WHERE target_pubkey = ?1")?
        .query_row([&list.target_pubkey], |r| r.get(0))
        .optional()?;
    if stored_iat.is_some_and(|s| s >= list.iat_ms) {
        return Ok(SenderListOutcome::Stale);
    }
    let mut seen = HashSet::with_capacity(list.senders.len());
    let senders: Vec<&String> = list
        .senders
        .iter()
        .filter(|s| seen.insert(s.as_str()))
        .collect();
    let senders = serde_json::to_string(&senders)
        .map_err(|e| StoreError::InvalidInput(format!("sender list cannot be encoded: {e}")))?;
    c.prepare_cached(
        "INSERT INTO sender_lists (target_pubkey, senders, iat, record, sig)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(target_pubkey) DO UPDATE SET senders = excluded.senders,
           iat = excluded.iat, record = excluded.record, sig = excluded.sig",
    )?
    .execute(params![
        list.target_pubkey,
        senders,
        list.iat_ms,
        list.record,
        list.sig
    ])?;
    Ok(SenderListOutcome::Stored)
}

impl DirectoryStore for SqliteStore {
    fn enrol(&self, req: EnrolRequest) -> Result<EnrolOutcome, StoreError> {
        if !is_canonical_key(&req.host_pubkey) {
            return Err(StoreError::InvalidInput(
                "a host key must be enrolled in canonical form (padded standard base64 of 32 bytes)"
                    .to_owned(),
            ));
        }
        self.submit(JobKind::Other, move |c, limits| {
            enrol_apply(c, limits, &req)
        })
    }

    fn enrolment(&self, host_pubkey: &str) -> Result<Option<Enrolment>, StoreError> {
        self.read(|c| enrolment_row(c, host_pubkey))
    }

    fn live_enrolments_by_name(&self, host_name: &str) -> Result<Vec<Enrolment>, StoreError> {
        self.read(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {ENROLMENT_COLS} FROM enrolments
                 WHERE lower(host_name) = lower(?1) AND revoked_at IS NULL
                 ORDER BY enrolled_at DESC, rowid DESC
                 LIMIT ?2"
            ))?;
            let limit = i64::try_from(crate::store::MAX_LIVE_BY_NAME).unwrap_or(i64::MAX);
            let rows = st
                .query_map(params![host_name, limit], enrolment_from_row)?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
    }

    fn live_enrolment_count(&self) -> Result<u64, StoreError> {
        self.read(live_enrolment_count)
    }

    fn revoke(&self, host_pubkey: &str, now_ms: i64) -> Result<RevokeOutcome, StoreError> {
        let key = host_pubkey.to_owned();
        self.submit(JobKind::Other, move |c, _| revoke_apply(c, &key, now_ms))
    }

    fn put_enc_ad_v1(&self, ad: EncAdV1) -> Result<(), StoreError> {
        self.submit(JobKind::Other, move |c, _| {
            c.execute(
                "INSERT INTO enc_ads (host_pubkey, host_name, enc_pub, sig, at)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(host_pubkey) DO UPDATE SET host_name = excluded.host_name,
                   enc_pub = excluded.enc_pub, sig = excluded.sig, at = excluded.at",
                params![ad.host_pubkey, ad.host_name, ad.enc_pub, ad.sig, ad.at_ms],
            )?;
            Ok(())
        })
    }

    fn put_enc_ad_v2(&self, ad: EncAdV2) -> Result<(), StoreError> {
        self.submit(JobKind::Other, move |c, _| {
            c.execute(
                "INSERT INTO enc_ad_records (host_pubkey, enc_pub, record, sig, at)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(host_pubkey) DO UPDATE SET enc_pub = excluded.enc_pub,
                   record = excluded.record, sig = excluded.sig, at = excluded.at",
                params![ad.host_pubkey, ad.enc_pub, ad.record, ad.sig, ad.at_ms],
            )?;
            Ok(())
        })
    }

    fn get_enc_ad(&self, host_pubkey: &str) -> Result<Option<EncAd>, StoreError> {
        self.read(|c| get_enc_ad(c, host_pubkey))
    }

    fn put_sender_list(&self, list: SenderList) -> Result<SenderListOutcome, StoreError> {
        self.submit(JobKind::Other, move |c, _| put_sender_list(c, list))
    }

    fn rotate(
        &self,
        req: crate::store::RotateRequest,
    ) -> Result<crate::store::RotateOutcome, StoreError> {
        if !is_canonical_key(&req.old_pubkey) || !is_canonical_key(&req.new_pubkey) {
            return Err(StoreError::InvalidInput(
                "rotation keys must be in canonical form (padded standard base64 of 32 bytes)"
                    .to_owned(),
            ));
        }
        self.submit(JobKind::Other, move |c, _| rotate::rotate_apply(c, &req))
    }

    fn sender_list(&self, target_pubkey: &str) -> Result<Option<SenderList>, StoreError> {
        self.read(|c| {
            let row = c
                .prepare_cached(
                    "SELECT senders, iat, record, sig FROM sender_lists WHERE target_pubkey = ?1",
                )?
                .query_row([target_pubkey], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                })
                .optional()?;
            let Some((senders, iat_ms, record, sig)) = row else {
                return Ok(None);
            };
            let senders: Vec<String> = serde_json::from_str(&senders).map_err(|e| {
                StoreError::Corrupt(format!("stored sender list is not a JSON array: {e}"))
            })?;
            Ok(Some(SenderList {
                target_pubkey: target_pubkey.to_owned(),
                senders,
                iat_ms,
                record,
                sig,
            }))
        })
    }

    fn enrol_bound(
        &self,
        req: EnrolRequest,
        binding: Option<crate::store::AccountBinding>,
    ) -> Result<EnrolOutcome, StoreError> {
        deny::enrol_bound(self, req, binding)
    }

    fn account_binding(
        &self,
        host_pubkey: &str,
    ) -> Result<Option<crate::store::AccountBinding>, StoreError> {
        deny::account_binding(self, host_pubkey)
    }

    fn deny(
        &self,
        entry: crate::store::DenyEntry,
    ) -> Result<crate::store::DenyOutcome, StoreError> {
        deny::deny(self, entry)
    }

    fn undeny(&self, kind: crate::store::DenyKind, value: &str) -> Result<bool, StoreError> {
        deny::undeny(self, kind, value)
    }

    fn deny_entries(&self) -> Result<Vec<crate::store::DenyEntry>, StoreError> {
        deny::deny_entries(self)
    }

    fn revoke_logged(
        &self,
        host_pubkey: &str,
        now_ms: i64,
        log: crate::store::OpEntry,
    ) -> Result<RevokeOutcome, StoreError> {
        deny::revoke_logged(self, host_pubkey, now_ms, log)
    }

    fn deny_logged(
        &self,
        entry: crate::store::DenyEntry,
        log: crate::store::OpEntry,
    ) -> Result<crate::store::DenyOutcome, StoreError> {
        deny::deny_logged(self, entry, log)
    }

    fn undeny_logged(
        &self,
        kind: crate::store::DenyKind,
        value: &str,
        log: crate::store::OpEntry,
    ) -> Result<bool, StoreError> {
        deny::undeny_logged(self, kind, value, log)
    }

    fn denied(
        &self,
        host_fp: &str,
        client_id: Option<&str>,
        now_ms: i64,
    ) -> Result<Option<crate::store::DenyEntry>, StoreError> {
        deny::denied(self, host_fp, client_id, now_ms)
    }

    fn enrolments_by_fingerprint(&self, fp: &str) -> Result<Vec<Enrolment>, StoreError> {
        deny::enrolments_by_fingerprint(self, fp)
    }
}
