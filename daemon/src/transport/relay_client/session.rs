//! Opening a relay session each pass (spec §1, §8; `wire.md` §3.5 "Session open"): signed
//! `GET /v2/relay/info`, the pinned-key check, enrolment when the relay does not know this host
//! key (after a restart, a restore or a wipe: never a permanent "enrolled" flag, G6), and the
//! v2 enc-key ad when the relay's copy is missing, different or close to expiry.

use serde_json::json;

use agentmbx_protocol::records::{self, EncAd};
use agentmbx_protocol::wire::{ChallengeResponse, Limits, RelayInfo};

use super::{status_error, RelayClient, RelayError};

/// Republish the ad when the relay's copy expires within this many ms (7 days).
pub const AD_REFRESH_BEFORE_MS: i64 = 7 * 86_400_000;

/// What a session learned from the relay.
#[derive(Debug, Clone)]
pub struct Session {
    /// Current epoch.
    pub epoch: String,
    /// Published limits.
    pub limits: Limits,
    /// The relay's view of this host's queue head.
    pub head_seq: i64,
}

impl RelayClient {
    /// Opens a session: info, key check, enrolment and ad as needed. Errors: [`RelayError`];
    /// [`RelayError::KeyMismatch`] means relay use must stop until the owner confirms.
    pub async fn open_session(&self) -> Result<Session, RelayError> {
        let mut info: RelayInfo = self.call_json("GET", "/v2/relay/info", "").await?;
        if info.relay_pubkey != self.relay_key.to_b64() {
            let served = agentmbx_protocol::keys::PublicKey::from_b64(&info.relay_pubkey)
                .map(|k| k.fingerprint())
                .unwrap_or_else(|_| "unparseable".into());
            return Err(RelayError::KeyMismatch {
                pinned: self.relay_key.fingerprint(),
                served,
            });
        }
        self.note_epoch(&info.epoch).await?;
        let me = self.ident.host_key.public().to_b64();
        let enrolled = info
            .you
            .as_ref()
            .is_some_and(|y| y.pubkey == me && y.host == self.ident.host.as_str());
        if !enrolled {
            self.enrol().await?;
            info = self.call_json("GET", "/v2/relay/info", "").await?;
            if info.you.as_ref().is_none_or(|y| y.pubkey != me) {
                return Err(RelayError::Malformed(
                    "relay does not confirm the enrolment".into(),
                ));
            }
        }
        let now = self.clock.now_ms();
        let enc_pub = self.ident.enc_key.public().to_b64();
        let ad_ok = info
            .you
            .as_ref()
            .and_then(|y| y.enc_ad.as_ref())
            .is_some_and(|a| {
                !a.v1
                    && a.enc_pub == enc_pub
                    && agentmbx_protocol::time::parse_iso_ms(&a.exp)
                        .is_some_and(|exp| exp - now > AD_REFRESH_BEFORE_MS)
            });
        if !ad_ok {
            // Pulling needs no ad: a refused or failed publish must not stop receiving.
            if let Err(e) = self.publish_enc_ad().await {
                tracing::warn!(relay = %self.url, error = %e, "enc-key ad not published; peers cannot seal new mail for this host until it is");
            }
        }
        Ok(Session {
            epoch: info.epoch,
            limits: info.limits,
            head_seq: info.you.map_or(0, |y| y.head_seq),
        })
    }

    /// Records the relay epoch; on a change, re-pushes every relay-accepted row of this relay
    /// (spec §5 "On seeing a new epoch": a sender re-pushes, dedup makes it safe).
    async fn note_epoch(&self, epoch: &str) -> Result<(), RelayError> {
        let (url, ep, now) = (self.url.clone(), epoch.to_string(), self.clock.now_ms());
        let moved = self
            .mailbox
            .run(move |c| {
                let tx = c.transaction()?;
                let key = format!("relay-epoch:{url}");
                let old = crate::mailbox::relay_state::kv_get(&tx, &key)?;
                let mut moved = 0;
                if old.as_deref() != Some(ep.as_str()) {
                    if old.is_some() {
                        moved = crate::mailbox::outbox::repush_for_epoch(&tx, &url, &ep, now)?;
                    }
                    crate::mailbox::relay_state::kv_set(&tx, &key, &ep)?;
                }
                tx.commit()?;
                Ok(moved)
            })
            .await?;
        if moved > 0 {
            tracing::warn!(relay = %self.url, epoch, rows = moved, "relay epoch changed: pushing relay-accepted mail again");
        }
        Ok(())
    }

    /// Host-key challenge enrolment: `POST /v1/relay/challenge` then `POST /v1/relay/enrol`
    /// with the signature over canonical(`{v:1, challenge, host, pubkey, owner_fp}`).
    pub async fn enrol(&self) -> Result<(), RelayError> {
        let host = self.ident.host.as_str();
        let pubkey = self.ident.host_key.public().to_b64();
        let body = json!({"host": host, "pubkey": pubkey}).to_string();
        let ch: ChallengeResponse = self.post_plain("/v1/relay/challenge", &body).await?;
        let sig = self
            .ident
            .host_key
            .sign(records::enrol_canonical(&ch.challenge, host, &pubkey, "").as_bytes());
        let body = json!({"host": host, "pubkey": pubkey, "owner_fp": "", "sig": sig}).to_string();
        let _: serde_json::Value = self.post_plain("/v1/relay/enrol", &body).await?;
        tracing::info!(relay = %self.url, "enrolled with the relay");
        Ok(())
    }

    /// Publishes a fresh signed v2 enc-key ad (`POST /v2/relay/enc-key {ad, sig}`).
    pub async fn publish_enc_ad(&self) -> Result<(), RelayError> {
        let ad = EncAd::new(
            self.ident.host.as_str(),
            &self.ident.host_key.public(),
            &self.ident.enc_key.public().to_b64(),
            self.clock.now_ms(),
        );
        let sig = ad.sign(&self.ident.host_key);
        let body = json!({"ad": ad.to_value(), "sig": sig}).to_string();
        let _: serde_json::Value = self.call_json("POST", "/v2/relay/enc-key", &body).await?;
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
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
        if !(200..300).contains(&status) {
            return Err(status_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| RelayError::Malformed(e.to_string()))
    }
}
