//! `POST /v1/rotate {records:[≤50]}`: a paired host announces that it rotated its host key
//! (`wire.md` §2.10, §4; spec §2 "Rotation"). Unsigned by design: a rotated peer signs its hops
//! with a key this host has not pinned yet, so each record authenticates itself (signed by the
//! pinned old key and by the new key, [`SignedRotation::check`]).
//!
//! Order: the per-address rate limit, [`ROTATE_REQS_PER_MIN`] a minute per client address (429
//! `{error}` with `Retry-After`, before any byte of the body is read; the table holds at most
//! [`MAX_ROTATE_CLIENTS`] addresses) → the body, at most [`MAX_ROTATE_BODY`] bytes (413) → JSON
//! (400) → `records` an array of at most [`MAX_RECORDS_PER_ANNOUNCE`] (400 `bad batch`) → each
//! record in order, in its own transaction ([`accept_record`]). The answer `{results:[…]}`
//! (0.5.x: one string per record, `rotated`, `current` or `rejected:<why>`) is sent after the
//! last commit. The refused records of a request are logged as one line (how many, the first
//! reason), at WARN at most once a minute per client address, else at DEBUG.
//!
//! A record is matched by key: the peer pinned to `old_pub` (its name must be `rec.host`), or
//! the peer already pinned to `new_pub` (`current`), or a peer named `rec.host` whose retired
//! keys hold both keys (a step of a chain it already took: `current`); anything else is refused
//! with 0.5.x's texts (`host not paired`, `rotation does not start from the pinned host key`, …).
//! A record dated more than 5 minutes ahead of this host's clock, or whose `iat` is not an ISO
//! ms time, is refused ([`SignedRotation::check_time`]), and so is a rotation back to one of
//! the peer's retired keys ([`peers::ROTATION_TO_RETIRED`]: the earlier records are public, and
//! replaying them would flip the pin back and forth).
//! An accepted record moves the pin, the enc key and the retired keys ([`peers::rotate`]),
//! retargets the mail still waiting for the old key ([`outbox::retarget`]) and is audited
//! `peer.rotated` (fingerprints only), all in one transaction; then the sender loops are woken.
//!
//! This module never pins a key that did not sign the record, never moves a pin from a key other
//! than the pinned one, and never logs or audits a key, a signature or a record: fingerprints and
//! fixed reasons only. A record refused changes nothing.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use rusqlite::{Connection, TransactionBehavior};
use serde_json::{json, Value};

use agentmbx_net::body::{read_capped, BodyError};
use agentmbx_net::log_gate::LogGate;
use agentmbx_net::rate::{RateTable, Verdict, WhenFull};
use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::rotation::{
    RotateAnswer, RotateResult, RotationError, SignedRotation, MAX_RECORDS_PER_ANNOUNCE,
};

use super::{parse_json, HttpError};
use crate::mailbox::peers::{self, Rotated};
use crate::mailbox::{audit, outbox, MailboxError};
use crate::transport::lan::SharedLan;

/// Rotation announcements one client address may make per minute (`wire.md` §4: 30/min; a
/// burst of 30, then one every 2 s).
pub const ROTATE_REQS_PER_MIN: u32 = 30;
/// Most client addresses the rate table holds; past it the address closest to a full budget
/// is forgotten first (a forgotten address starts with a full budget, as it would anyway).
pub const MAX_ROTATE_CLIENTS: usize = 1024;
/// Largest `POST /v1/rotate` body accepted, in bytes (64 KiB: 50 records are about 25 KiB).
pub const MAX_ROTATE_BODY: usize = 64 * 1024;

/// 429 text (0.5.x).
pub const TOO_MANY: &str = "too many key rotation announcements; retry later";
/// 400 text for a body that is not `{records:[≤50]}` (0.5.x).
pub const BAD_BATCH: &str = "bad batch";
/// Refusal of a record whose host is not a peer here (0.5.x).
pub const NOT_PAIRED: &str = "host not paired";
/// Refusal of a record whose old key is pinned under another name than `rec.host`.
pub const WRONG_HOST: &str = "rotation names another host than the one its key is pinned for";
/// Refusal of a record whose new key is already pinned as another peer.
pub const NEW_KEY_TAKEN: &str = "the new host key is already pinned as another peer";
/// A request's refused records are summed up in one log line, at WARN at most once per this
/// many ms per client address (else at DEBUG), so a flood of bad records cannot flood the log.
pub const REFUSAL_WARN_EVERY_MS: i64 = 60_000;

/// The route, merged into the LAN router outside the shared body cap (this route reads its
/// own, smaller one after the rate check).
pub fn router(clock: SharedClock) -> Router<SharedLan> {
    let limiter = Arc::new(AddressLimiter::new(
        clock,
        ROTATE_REQS_PER_MIN,
        MAX_ROTATE_CLIENTS,
    ));
    let gate = Arc::new(LogGate::new(REFUSAL_WARN_EVERY_MS, MAX_ROTATE_CLIENTS));
    Router::new().route(
        "/v1/rotate",
        post(move |State(state): State<SharedLan>, req: Request| {
            let (limiter, gate) = (limiter.clone(), gate.clone());
            async move { handle(state, &limiter, &gate, req).await }
        }),
    )
}

/// A per-client-address rate limit (GCRA: a burst of `per_minute`, refilled evenly over the
/// minute) in a table of at most `cap` addresses, timed by the daemon's clock: a [`RateTable`]
/// that forgets the addresses closest to a full budget when full ([`WhenFull`]).
#[derive(Debug)]
pub struct AddressLimiter {
    clock: SharedClock,
    table: RateTable,
}

impl AddressLimiter {
    /// `per_minute` requests a minute per address (at least 1), at most `cap` addresses (at
    /// least 1) remembered.
    pub fn new(clock: SharedClock, per_minute: u32, cap: usize) -> Self {
        let cap = u64::try_from(cap).unwrap_or(u64::MAX);
        AddressLimiter {
            clock,
            table: RateTable::new(u64::from(per_minute), cap)
                .when_full(WhenFull::ForgetClosestToFull),
        }
    }

    /// Counts one request from `addr` (IPv4-mapped IPv6 counts as its IPv4 address): `Ok`
    /// when allowed, else how long until the next one is.
    pub fn check(&self, addr: IpAddr) -> Result<(), Duration> {
        let key = addr.to_canonical().to_string();
        match self.table.hit(&key, self.clock.now_ms()) {
            Verdict::Allowed => Ok(()),
            Verdict::Limited { retry_after_ms } | Verdict::TableFull { retry_after_ms } => Err(
                Duration::from_millis(u64::try_from(retry_after_ms).unwrap_or(1)),
            ),
        }
    }

    /// Addresses held now (never more than the cap).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no address is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What one record came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The answer for the record.
    pub result: RotateResult,
    /// The pin that moved, when the record was `rotated`.
    pub rotated: Option<Rotated>,
    /// Outbox rows moved to the new key.
    pub retargeted: usize,
}

impl Outcome {
    fn refused(why: impl Into<String>) -> Self {
        Outcome {
            result: RotateResult::Rejected(why.into()),
            rotated: None,
            retargeted: 0,
        }
    }

    fn current() -> Self {
        Outcome {
            result: RotateResult::Current,
            rotated: None,
            retargeted: 0,
        }
    }
}

fn fingerprint(b64: &str) -> String {
    PublicKey::from_b64(b64)
        .map(|k| k.fingerprint())
        .unwrap_or_default()
}

/// Checks and applies one announced record inside the caller's transaction (module docs: the
/// matching rules). `rotated` moved the pin of `rec.host` to `new_pub`, set its enc key to
/// `new_enc_pub`, appended `old_pub` to its retired keys, retargeted its waiting outbox rows
/// and audited `peer.rotated`; `current` and `rejected:<why>` changed nothing. Errors: storage
/// faults only.
pub fn accept_record(
    conn: &Connection,
    record: &Value,
    now_ms: i64,
) -> Result<Outcome, MailboxError> {
    let not_a_record = || Outcome::refused(RotationError::NotARecord.to_string());
    let Ok(signed) = SignedRotation::from_value(record) else {
        return Ok(not_a_record());
    };
    let rec = &signed.rec;
    // Keys are looked up in their canonical text, as pinned.
    let (Ok(old), Ok(new)) = (
        PublicKey::from_b64(&rec.old_pub),
        PublicKey::from_b64(&rec.new_pub),
    ) else {
        return Ok(not_a_record());
    };
    let Ok(new_enc) = signed.new_enc_key() else {
        return Ok(not_a_record());
    };
    let (old_b64, new_b64) = (old.to_b64(), new.to_b64());

    if let Some(peer) = peers::by_key(conn, &old_b64)? {
        if peer.host != rec.host {
            return Ok(Outcome::refused(WRONG_HOST));
        }
        if let Err(why) = signed.check(&old).and_then(|()| signed.check_time(now_ms)) {
            return Ok(Outcome::refused(why.to_string()));
        }
        if peers::prev_keys(conn, &peer.host)?.contains(&new_b64) {
            // Its earlier records are public: anyone could replay them to flip the pin back.
            return Ok(Outcome::refused(peers::ROTATION_TO_RETIRED));
        }
        let iat = agentmbx_protocol::time::parse_iso_ms(&rec.iat);
        let moved = match peers::rotate(
            conn,
            &peer.host,
            &old_b64,
            &new_b64,
            &new_enc.to_b64(),
            iat,
            now_ms,
        ) {
            Ok(Some(moved)) => moved,
            // The pin changed between the lookup and the update: not from the pinned key.
            Ok(None) => return Ok(Outcome::refused(RotationError::NotFromPinned.to_string())),
            Err(MailboxError::Conflict(_)) => return Ok(Outcome::refused(NEW_KEY_TAKEN)),
            Err(e) => return Err(e),
        };
        let retargeted = outbox::retarget(conn, &peer.host, &old_b64, &new_b64, now_ms)?;
        audit::record(
            conn,
            now_ms,
            "peer.rotated",
            &json!({
                "host": peer.host,
                "from": old.fingerprint(),
                "to": new.fingerprint(),
                "outbox_retargeted": retargeted,
            }),
        )?;
        return Ok(Outcome {
            result: RotateResult::Rotated,
            rotated: Some(moved),
            retargeted,
        });
    }
    if peers::by_key(conn, &new_b64)?.is_some_and(|p| p.host == rec.host) {
        return Ok(Outcome::current());
    }
    let Some(peer) = peers::by_name(conn, &rec.host)? else {
        return Ok(Outcome::refused(NOT_PAIRED));
    };
    let retired = peers::prev_keys(conn, &peer.host)?;
    if retired.contains(&old_b64) && retired.contains(&new_b64) {
        // An earlier step of a chain of rotations this host already followed.
        return Ok(Outcome::current());
    }
    let why = match PublicKey::from_b64(&peer.pubkey) {
        Ok(pinned) => match signed.check(&pinned) {
            Err(why) => why,
            Ok(()) => RotationError::NotFromPinned,
        },
        Err(_) => RotationError::NotFromPinned,
    };
    Ok(Outcome::refused(why.to_string()))
}

/// 429 `{error:`[`TOO_MANY`]`}` with `Retry-After` in whole seconds, rounded up (at least 1).
fn too_many(wait: Duration) -> Response {
    let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
    agentmbx_net::rate::too_many(
        wait_ms,
        HttpError::new(StatusCode::TOO_MANY_REQUESTS, TOO_MANY),
    )
}

/// The records of a `{records:[≤50]}` body, else 400 [`BAD_BATCH`].
fn records(body: Value) -> Result<Vec<Value>, HttpError> {
    let records = match body {
        Value::Object(mut map) => map.remove("records"),
        _ => None,
    };
    match records {
        Some(Value::Array(items)) if items.len() <= MAX_RECORDS_PER_ANNOUNCE => Ok(items),
        _ => Err(HttpError::bad_request(BAD_BATCH)),
    }
}

async fn handle(
    state: SharedLan,
    limiter: &AddressLimiter,
    gate: &LogGate,
    req: Request,
) -> Response {
    let remote = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| c.0.ip());
    if let Err(wait) = limiter.check(remote) {
        // Not a warning: a flood would fill the log.
        tracing::debug!(client = %remote, "key rotation announcements over the rate limit");
        return too_many(wait);
    }
    let body = match read_capped(req.into_body(), MAX_ROTATE_BODY).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => return HttpError::too_large(MAX_ROTATE_BODY).into_response(),
        Err(BodyError::Broken) => {
            return HttpError::bad_request("request body could not be read").into_response()
        }
    };
    match answer(&state, &body, remote, gate).await {
        Ok(a) => Json(a).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn answer(
    state: &SharedLan,
    body: &[u8],
    remote: IpAddr,
    gate: &LogGate,
) -> Result<RotateAnswer, HttpError> {
    let records = records(parse_json(body)?)?;
    let now = state.clock.now_ms();
    let outcomes = state
        .mailbox
        .run(move |conn| {
            let mut out = Vec::with_capacity(records.len());
            for record in &records {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let outcome = accept_record(&tx, record, now)?;
                if outcome.rotated.is_some() {
                    tx.commit()?;
                }
                out.push(outcome);
            }
            Ok(out)
        })
        .await?;
    let mut moved = false;
    let (mut refused, mut first_reason) = (0usize, None::<&str>);
    for o in &outcomes {
        match (&o.result, &o.rotated) {
            (RotateResult::Rotated, Some(r)) => {
                moved = true;
                tracing::info!(
                    peer = %r.host,
                    from = %fingerprint(&r.old_pub),
                    to = %fingerprint(&r.new_pub),
                    retargeted = o.retargeted,
                    "the peer rotated its host key: pin moved, the old key only verifies mail signed before"
                );
            }
            (RotateResult::Rejected(why), _) => {
                refused += 1;
                first_reason.get_or_insert(why.as_str());
            }
            _ => {}
        }
    }
    if let Some(first) = first_reason {
        // One line per request; at WARN at most once a minute per address (anyone can send
        // bad records).
        let client = match remote {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        if gate.warn(&client.to_string(), now) {
            tracing::warn!(%client, refused, first_reason = %first, "key rotation records refused (further refusals from this address in the next minute are logged at debug)");
        } else {
            tracing::debug!(%client, refused, first_reason = %first, "key rotation records refused");
        }
    }
    if moved {
        // Mail for the peer is due now, sealed for its new key; the allowlist follows the pin.
        state.wake.notify_one();
    }
    Ok(RotateAnswer {
        results: outcomes.into_iter().map(|o| o.result).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use agentmbx_protocol::clock::ManualClock;
    use agentmbx_protocol::keys::{EncKey, HostKey};
    use agentmbx_protocol::records::Receipt;

    use crate::identity::Identity;
    use crate::mailbox::outbox::Accepted;
    use crate::node::{receipts, receive};
    use crate::testutil::{self, Store, T0};
    use crate::transport::lan::client::{LanClient, LanError};
    use crate::transport::lan::server::serve;
    use crate::transport::lan::LanState;

    /// `beta` serving its LAN routes; it pinned `alpha` (old keys, enc key known).
    struct Fx {
        addr: String,
        state: SharedLan,
        store: Store,
        clock: Arc<ManualClock>,
        beta: Arc<Identity>,
        alpha_old: Identity,
        alpha_new: Identity,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    fn with_keys(host: &str, host_key: HostKey, enc_key: EncKey) -> Identity {
        Identity {
            host_key,
            enc_key,
            ..testutil::identity(host)
        }
    }

    fn same(i: &Identity) -> Identity {
        with_keys(
            i.host.as_str(),
            HostKey::from_seed_b64(&i.host_key.seed_b64_secret()).unwrap(),
            EncKey::from_private_b64(&i.enc_key.private_b64_secret()).unwrap(),
        )
    }

    async fn fx() -> Fx {
        crate::install_tls_provider();
        let beta = Arc::new(testutil::identity("beta"));
        let alpha_old = testutil::identity("alpha");
        let alpha_new = testutil::identity("alpha");
        let store = testutil::store();
        store.add_peer(&alpha_old, true);
        let clock = testutil::clock();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let state = Arc::new(LanState {
            ident: beta.clone(),
            mailbox: store.mailbox.clone(),
            clock: clock.clone(),
            version: "test",
            started_at: agentmbx_protocol::time::iso_ms(T0),
            port: listener.local_addr().unwrap().port(),
            advertise: String::new(),
            self_addrs: Vec::new(),
            wake: Arc::new(tokio::sync::Notify::new()),
            pairing: crate::pairing::PairingMemory::default(),
            instance: Default::default(),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Fx {
            addr,
            state,
            store,
            clock,
            beta,
            alpha_old,
            alpha_new,
            _stop: stop,
        }
    }

    impl Fx {
        /// alpha's rotation from its old keys to its new ones, issued at `T0`.
        fn rotation(&self) -> Value {
            let r = SignedRotation::sign(
                "alpha",
                &self.alpha_old.host_key,
                &self.alpha_new.host_key,
                &self.alpha_new.enc_key.public(),
                T0,
            );
            serde_json::to_value(r).unwrap()
        }

        async fn post_raw(&self, body: Vec<u8>) -> (u16, Option<String>, Value) {
            let res = reqwest::Client::new()
                .post(format!("http://{}/v1/rotate", self.addr))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = res.status().as_u16();
            let retry = res
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            (status, retry, res.json().await.unwrap_or(Value::Null))
        }

        async fn announce(&self, records: &[Value]) -> Vec<String> {
            let body = serde_json::to_vec(&json!({ "records": records })).unwrap();
            let (status, _, answer) = self.post_raw(body).await;
            assert_eq!(status, 200, "{answer}");
            serde_json::from_value(answer["results"].clone()).unwrap()
        }

        fn alpha(&self) -> (String, Option<String>, Option<i64>, Vec<String>) {
            let c = self.store.fresh_conn();
            let p = peers::by_name(&c, "alpha").unwrap().unwrap();
            (
                p.pubkey,
                p.enc_pub,
                p.enc_ad_iat,
                peers::prev_keys(&c, "alpha").unwrap(),
            )
        }

        fn audits(&self) -> i64 {
            self.store
                .scalar("SELECT COUNT(*) FROM audit WHERE event = 'peer.rotated'")
        }

        fn send_to_alpha(&self, id: &str) {
            self.store
                .send(&self.beta, "bob", &["ann@alpha"], id, id, T0)
                .unwrap();
        }
    }

    fn b64(i: &Identity) -> String {
        i.host_key.public().to_b64()
    }

    #[tokio::test]
    async fn an_announced_rotation_moves_the_pin_and_retargets_the_mail_still_waiting() {
        let f = fx().await;
        let mut ids = testutil::ids();
        let (waiting, sealed, accepted, done) =
            (ids.next(T0), ids.next(T0), ids.next(T0), ids.next(T0));
        for id in [&waiting, &sealed, &accepted, &done] {
            f.send_to_alpha(id);
        }
        f.store
            .mailbox
            .with(|c| {
                // Backed off for an hour, with wire bytes sealed for the old target.
                c.execute(
                    "UPDATE outbox SET next_at = ?2 WHERE msg_id = ?1",
                    rusqlite::params![waiting, T0 + 3_600_000],
                )?;
                outbox::set_wire(c, &sealed, "alpha", b"sealed-for-old", "h1")?;
                outbox::set_wire(c, &accepted, "alpha", b"accepted-for-old", "h2")?;
                let a = Accepted {
                    relay: "http://relay",
                    epoch: "e",
                    seq: 7,
                    accept: "{}",
                    sig: "s",
                    accepted_at: T0,
                    deadline_at: T0 + 1,
                };
                assert!(outbox::settle_accepted(c, &accepted, "alpha", &a, T0)?);
                assert!(outbox::delivered_lan(c, &done, "alpha", T0)?);
                Ok(())
            })
            .unwrap();
        f.clock.advance(1_000);
        let woken = f.state.wake.clone();
        let woke = tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(10), woken.notified())
                .await
                .is_ok()
        });
        tokio::task::yield_now().await;

        let record = f.rotation();
        assert_eq!(
            f.announce(std::slice::from_ref(&record)).await,
            vec!["rotated"]
        );
        assert!(woke.await.unwrap(), "the sender loops were woken");
        let (pin, enc, enc_iat, prev) = f.alpha();
        assert_eq!(pin, b64(&f.alpha_new));
        assert_eq!(enc, Some(f.alpha_new.enc_key.public().to_b64()));
        assert_eq!(
            enc_iat,
            Some(T0),
            "the enc-ad guard restarts at the rotation"
        );
        assert_eq!(prev, vec![b64(&f.alpha_old)]);

        type Row = (String, String, String, Option<Vec<u8>>, i64);
        let rows: Vec<Row> = f
            .store
            .fresh_conn()
            .prepare(
                "SELECT msg_id, state, target_pubkey, wire, next_at FROM outbox ORDER BY msg_id",
            )
            .unwrap()
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let row = |id: &str| rows.iter().find(|r| r.0 == id).unwrap().clone();
        let now = T0 + 1_000;
        // Waiting rows target the new key, due now, to be sealed again.
        assert_eq!(row(&waiting).2, b64(&f.alpha_new));
        assert_eq!((row(&waiting).3, row(&waiting).4), (None, now));
        assert_eq!(row(&sealed).2, b64(&f.alpha_new));
        assert_eq!(row(&sealed).3, None, "bytes sealed for the old key dropped");
        assert_eq!(row(&sealed).4, T0, "a row already due stays due");
        // A relay-accepted row keeps its target and bytes; a settled one is untouched.
        assert_eq!(row(&accepted).1, "relay-accepted");
        assert_eq!(row(&accepted).2, b64(&f.alpha_old));
        assert_eq!(row(&accepted).3.as_deref(), Some(&b"accepted-for-old"[..]));
        assert_eq!(
            (row(&done).1.as_str(), row(&done).2.clone()),
            ("delivered", b64(&f.alpha_old))
        );

        // Audited once, with fingerprints only.
        assert_eq!(f.audits(), 1);
        let detail: String = f.store.scalar("SELECT detail FROM audit");
        let detail: Value = serde_json::from_str(&detail).unwrap();
        assert_eq!(detail["host"], "alpha");
        assert_eq!(detail["from"], f.alpha_old.host_key.public().fingerprint());
        assert_eq!(detail["to"], f.alpha_new.host_key.public().fingerprint());
        assert_eq!(detail["outbox_retargeted"], 2);
        let text = detail.to_string();
        assert!(!text.contains(&b64(&f.alpha_old)) && !text.contains(&b64(&f.alpha_new)));

        // The same record again: already current, nothing changes.
        assert_eq!(f.announce(&[record]).await, vec!["current"]);
        assert_eq!(f.alpha().0, b64(&f.alpha_new));
        assert_eq!(f.audits(), 1);
    }

    #[tokio::test]
    async fn each_refusal_has_its_reason_and_changes_nothing() {
        let f = fx().await;
        let good = f.rotation();
        let mut bad_old = good.clone();
        bad_old["old_sig"] = good["new_sig"].clone();
        let mut bad_new = good.clone();
        bad_new["new_sig"] = good["old_sig"].clone();
        let same_key = serde_json::to_value(SignedRotation::sign(
            "alpha",
            &f.alpha_old.host_key,
            &f.alpha_old.host_key,
            &f.alpha_new.enc_key.public(),
            T0,
        ))
        .unwrap();
        let stranger = HostKey::generate();
        let not_pinned = serde_json::to_value(SignedRotation::sign(
            "alpha",
            &stranger,
            &f.alpha_new.host_key,
            &f.alpha_new.enc_key.public(),
            T0,
        ))
        .unwrap();
        let unknown_host = serde_json::to_value(SignedRotation::sign(
            "gamma",
            &stranger,
            &HostKey::generate(),
            &EncKey::generate().public(),
            T0,
        ))
        .unwrap();
        let wrong_host = serde_json::to_value(SignedRotation::sign(
            "gamma",
            &f.alpha_old.host_key,
            &f.alpha_new.host_key,
            &f.alpha_new.enc_key.public(),
            T0,
        ))
        .unwrap();
        let mut extra_field = good.clone();
        extra_field["rec"]["note"] = "x".into();

        let results = f
            .announce(&[
                bad_old,
                bad_new,
                same_key,
                not_pinned,
                unknown_host,
                wrong_host,
                extra_field,
                json!({}),
                json!("rotated"),
            ])
            .await;
        assert_eq!(
            results,
            vec![
                "rejected:rotation is not signed by the pinned host key",
                "rejected:rotation is not signed by the new host key",
                "rejected:rotation keeps the same host key",
                "rejected:rotation does not start from the pinned host key",
                "rejected:host not paired",
                format!("rejected:{WRONG_HOST}").as_str(),
                "rejected:not a rotation record",
                "rejected:not a rotation record",
                "rejected:not a rotation record",
            ]
        );
        let (pin, enc, _, prev) = f.alpha();
        assert_eq!(pin, b64(&f.alpha_old));
        assert_eq!(enc, Some(f.alpha_old.enc_key.public().to_b64()));
        assert!(prev.is_empty());
        assert_eq!(f.audits(), 0);

        // Records are taken in order: a refusal does not stop the good one after it.
        let mut bad_old = good.clone();
        bad_old["old_sig"] = good["new_sig"].clone();
        assert_eq!(
            f.announce(&[bad_old, good.clone(), good]).await,
            vec![
                "rejected:rotation is not signed by the pinned host key",
                "rotated",
                "current"
            ]
        );
    }

    #[tokio::test]
    async fn a_new_key_pinned_as_another_peer_is_refused() {
        let f = fx().await;
        let gamma = testutil::identity("gamma");
        f.store.add_peer(&gamma, false);
        let record = serde_json::to_value(SignedRotation::sign(
            "alpha",
            &f.alpha_old.host_key,
            &gamma.host_key,
            &gamma.enc_key.public(),
            T0,
        ))
        .unwrap();
        assert_eq!(
            f.announce(&[record]).await,
            vec![format!("rejected:{NEW_KEY_TAKEN}")]
        );
        assert_eq!(f.alpha().0, b64(&f.alpha_old));
        assert_eq!(f.audits(), 0);
    }

    #[tokio::test]
    async fn a_rotation_back_to_a_retired_key_is_refused_so_old_records_cannot_be_replayed() {
        let f = fx().await;
        let forward = f.rotation();
        assert_eq!(
            f.announce(std::slice::from_ref(&forward)).await,
            vec!["rotated"]
        );
        // Back to the retired key, signed by both keys (the peer itself, or whoever holds the
        // old key): refused, the pin stays.
        let back = serde_json::to_value(SignedRotation::sign(
            "alpha",
            &f.alpha_new.host_key,
            &f.alpha_old.host_key,
            &f.alpha_old.enc_key.public(),
            T0 + 1,
        ))
        .unwrap();
        assert_eq!(
            f.announce(std::slice::from_ref(&back)).await,
            vec![format!("rejected:{}", peers::ROTATION_TO_RETIRED)]
        );
        let (pin, enc, _, prev) = f.alpha();
        assert_eq!(pin, b64(&f.alpha_new));
        assert_eq!(enc, Some(f.alpha_new.enc_key.public().to_b64()));
        assert_eq!(prev, vec![b64(&f.alpha_old)]);
        // Replaying the public records in any order never moves the pin again.
        assert_eq!(
            f.announce(&[forward.clone(), back.clone(), forward, back])
                .await,
            vec![
                "current".to_string(),
                format!("rejected:{}", peers::ROTATION_TO_RETIRED),
                "current".to_string(),
                format!("rejected:{}", peers::ROTATION_TO_RETIRED),
            ]
        );
        assert_eq!(f.alpha().0, b64(&f.alpha_new));
        assert_eq!(f.audits(), 1);
    }

    #[tokio::test]
    async fn a_record_dated_more_than_5_minutes_ahead_is_refused() {
        use agentmbx_protocol::clock::Clock as _;
        let f = fx().await;
        let now = f.clock.now_ms();
        let at = |iat: i64| {
            serde_json::to_value(SignedRotation::sign(
                "alpha",
                &f.alpha_old.host_key,
                &f.alpha_new.host_key,
                &f.alpha_new.enc_key.public(),
                iat,
            ))
            .unwrap()
        };
        let skew = agentmbx_protocol::rotation::FUTURE_SKEW_MS;
        let mut no_ms = at(now);
        no_ms["rec"]["iat"] = "2026-01-01T00:00:00Z".into();
        assert_eq!(
            f.announce(&[at(now + skew + 1), no_ms]).await,
            vec![
                "rejected:rotation is dated more than 5 minutes ahead",
                "rejected:rotation iat is not an ISO time with milliseconds",
            ]
        );
        assert_eq!(f.alpha().0, b64(&f.alpha_old));
        assert_eq!(f.announce(&[at(now + skew)]).await, vec!["rotated"]);
    }

    /// Log lines written while `f` runs on this thread (the server tasks of a current-thread
    /// test runtime run here too).
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn lines(&self, level: &str) -> Vec<String> {
            String::from_utf8_lossy(&self.0.lock().unwrap())
                .lines()
                .filter(|l| l.contains(level) && l.contains("key rotation records refused"))
                .map(str::to_owned)
                .collect()
        }
    }

    #[tokio::test]
    async fn refused_records_are_logged_as_one_line_per_request_and_warned_once_a_minute() {
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let f = fx().await;
        let flood = vec![json!({}); MAX_RECORDS_PER_ANNOUNCE];
        for _ in 0..3 {
            assert_eq!(f.announce(&flood).await.len(), MAX_RECORDS_PER_ANNOUNCE);
        }
        let warned = log.lines("WARN");
        assert_eq!(warned.len(), 1, "{warned:#?}");
        assert!(warned[0].contains("refused=50"), "{}", warned[0]);
        assert!(
            warned[0].contains("first_reason=not a rotation record"),
            "{}",
            warned[0]
        );
        assert!(warned[0].contains("client=127.0.0.1"), "{}", warned[0]);
        assert_eq!(log.lines("DEBUG").len(), 2, "the other requests, at debug");
        // A minute later the address is warned about again.
        f.clock.advance(REFUSAL_WARN_EVERY_MS);
        f.announce(&flood).await;
        assert_eq!(log.lines("WARN").len(), 2);
    }

    #[tokio::test]
    async fn a_chain_of_rotations_is_followed_in_order_and_its_steps_are_current_after() {
        let f = fx().await;
        let mid = testutil::identity("alpha");
        let step = |from: &Identity, to: &Identity| {
            serde_json::to_value(SignedRotation::sign(
                "alpha",
                &from.host_key,
                &to.host_key,
                &to.enc_key.public(),
                T0,
            ))
            .unwrap()
        };
        let first = step(&f.alpha_old, &mid);
        let second = step(&mid, &f.alpha_new);
        // Out of order, the second step does not start from the pin.
        assert_eq!(
            f.announce(&[second.clone(), first.clone()]).await,
            vec![
                "rejected:rotation does not start from the pinned host key",
                "rotated"
            ]
        );
        assert_eq!(
            f.announce(&[first.clone(), second.clone()]).await,
            vec!["current", "rotated"]
        );
        let (pin, _, _, prev) = f.alpha();
        assert_eq!(pin, b64(&f.alpha_new));
        assert_eq!(prev, vec![b64(&f.alpha_old), b64(&mid)]);
        // The whole log announced again (a lost answer): every step is current.
        assert_eq!(
            f.announce(&[first, second]).await,
            vec!["current", "current"]
        );
        assert_eq!(f.audits(), 2);
    }

    #[tokio::test]
    async fn batches_over_50_records_and_bodies_that_are_not_batches_are_refused() {
        let f = fx().await;
        let fifty = vec![json!({}); MAX_RECORDS_PER_ANNOUNCE];
        let results = f.announce(&fifty).await;
        assert_eq!(results.len(), 50);
        assert!(results
            .iter()
            .all(|r| r == "rejected:not a rotation record"));

        let mut fifty_one = fifty.clone();
        fifty_one[50 - 1] = f.rotation();
        fifty_one.push(f.rotation());
        let body = serde_json::to_vec(&json!({ "records": fifty_one })).unwrap();
        let (status, _, answer) = f.post_raw(body).await;
        assert_eq!((status, answer), (400, json!({"error": "bad batch"})));
        for body in [
            &b"{\"records\":{}}"[..],
            b"[]",
            b"{}",
            b"{\"records\":null}",
        ] {
            let (status, _, answer) = f.post_raw(body.to_vec()).await;
            assert_eq!((status, answer), (400, json!({"error": "bad batch"})));
        }
        let (status, _, answer) = f.post_raw(b"{not json".to_vec()).await;
        assert_eq!((status, answer), (400, json!({"error": "bad JSON body"})));
        // Nothing of the refused batches was applied.
        assert_eq!(f.alpha().0, b64(&f.alpha_old));
    }

    #[tokio::test]
    async fn the_body_cap_holds_at_64_kib() {
        let f = fx().await;
        let frame = serde_json::to_vec(&json!({ "records": [f.rotation()] })).unwrap();
        let pad = |n: usize| {
            let mut b = frame.clone();
            b.resize(n, b' ');
            b
        };
        let (status, _, answer) = f.post_raw(pad(MAX_ROTATE_BODY + 1)).await;
        assert_eq!(
            (status, answer),
            (413, json!({"error": "request body over 65536 bytes"}))
        );
        assert_eq!(f.alpha().0, b64(&f.alpha_old), "nothing applied");
        let (status, _, answer) = f.post_raw(pad(MAX_ROTATE_BODY)).await;
        assert_eq!((status, answer), (200, json!({"results": ["rotated"]})));
    }

    #[tokio::test]
    async fn thirty_announcements_a_minute_per_address_then_429_with_retry_after() {
        let f = fx().await;
        for i in 0..ROTATE_REQS_PER_MIN {
            let (status, _, _) = f.post_raw(b"{\"records\":[]}".to_vec()).await;
            assert_eq!(status, 200, "request {i}");
        }
        let (status, retry, answer) = f.post_raw(b"{\"records\":[]}".to_vec()).await;
        assert_eq!((status, retry.as_deref()), (429, Some("2")));
        assert_eq!(answer, json!({"error": TOO_MANY}));
        // A refused request reads no body and applies nothing.
        let body = serde_json::to_vec(&json!({ "records": [f.rotation()] })).unwrap();
        assert_eq!(f.post_raw(body.clone()).await.0, 429);
        assert_eq!(f.alpha().0, b64(&f.alpha_old));
        // One more every 2 s.
        f.clock.advance(2_000);
        assert_eq!(f.post_raw(body).await.0, 200);
        assert_eq!(f.post_raw(b"{\"records\":[]}".to_vec()).await.0, 429);
        // After a minute the whole budget is back.
        f.clock.advance(60_000);
        for _ in 0..ROTATE_REQS_PER_MIN {
            assert_eq!(f.post_raw(b"{\"records\":[]}".to_vec()).await.0, 200);
        }
    }

    #[test]
    fn the_rate_table_stays_bounded_under_a_flood_of_addresses() {
        let clock = testutil::clock();
        let limiter = AddressLimiter::new(clock.clone(), ROTATE_REQS_PER_MIN, MAX_ROTATE_CLIENTS);
        let addr = |i: u32| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
        // One address uses up its budget.
        for _ in 0..ROTATE_REQS_PER_MIN {
            assert!(limiter.check(addr(0)).is_ok());
        }
        assert_eq!(limiter.check(addr(0)), Err(Duration::from_millis(2_000)));
        // The same address written as IPv4-mapped IPv6 is the same client.
        let mapped = match addr(0) {
            IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
            v6 => v6,
        };
        assert!(limiter.check(mapped).is_err());
        // A flood of distinct addresses, each allowed, never grows the table past the cap.
        for i in 1..=5_000 {
            assert!(limiter.check(addr(i)).is_ok(), "address {i}");
            assert!(limiter.len() <= MAX_ROTATE_CLIENTS);
        }
        assert_eq!(limiter.len(), MAX_ROTATE_CLIENTS);
        // The table at its cap: addresses whose budget is full again make room first.
        clock.advance(60_000);
        assert!(limiter.check(addr(9_999)).is_ok());
        assert_eq!(limiter.len(), 1);
    }

    #[tokio::test]
    async fn mail_signed_by_a_retired_key_is_stored_once_but_a_hop_by_it_is_refused() {
        let f = fx().await;
        let beta_enc = f.beta.enc_key.public();
        let mut ids = testutil::ids();
        // Sealed and signed by alpha before it rotated; delivered after.
        let (lan_id, relay_id) = (ids.next(T0), ids.next(T0));
        let old_wire = |id: &str| {
            testutil::sealed_wire(
                &f.alpha_old,
                &beta_enc,
                id,
                "ann@alpha",
                &["bob@beta"],
                "s",
                T0,
            )
        };
        assert_eq!(f.announce(&[f.rotation()]).await, vec!["rotated"]);

        let client =
            |i: &Identity| LanClient::new(Arc::new(same(i)), testutil::clock(), 7400).unwrap();
        // A hop is now: the retired key no longer opens the LAN.
        match client(&f.alpha_old)
            .post_envelopes(&f.addr, &[old_wire(&lan_id)])
            .await
        {
            Err(LanError::Status { status: 401, error }) => {
                assert_eq!(error, "bad hop signature")
            }
            other => panic!("expected 401, got {other:?}"),
        }
        assert_eq!(f.store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 0);
        // The same mail through a hop by the new key: stored once.
        let new = client(&f.alpha_new);
        let got = new
            .post_envelopes(&f.addr, &[old_wire(&lan_id)])
            .await
            .unwrap();
        assert_eq!(got[0].result, "accepted");
        let got = new
            .post_envelopes(&f.addr, &[old_wire(&lan_id)])
            .await
            .unwrap();
        assert_eq!(got[0].result, "duplicate");

        // Pushed to the relay by the retired key before the rotation, pulled after.
        let wire = old_wire(&relay_id);
        let ident = same(&f.beta);
        let pull = |sender: String| {
            f.store
                .mailbox
                .with(|c| receive::receive_sealed(c, &ident, &wire, &relay_id, &sender, T0))
                .unwrap()
        };
        assert!(matches!(
            pull(b64(&f.alpha_old)),
            Ok(receive::Verdict::Stored { .. })
        ));
        assert_eq!(pull(b64(&f.alpha_old)), Ok(receive::Verdict::Duplicate));
        // A key alpha never held is no sender, and the new key does not sign the old bytes
        // into something else: still one copy of each.
        assert_eq!(
            pull(HostKey::generate().public().to_b64()),
            Err("host not paired".into())
        );
        let n: i64 = f
            .store
            .scalar("SELECT COUNT(*) FROM messages WHERE origin = 'alpha'");
        assert_eq!(n, 2);

        // A key the peer never held does not verify its mail, even over a good hop.
        let forged = testutil::sealed_wire(
            &with_keys("alpha", HostKey::generate(), EncKey::generate()),
            &beta_enc,
            &ids.next(T0),
            "ann@alpha",
            &["bob@beta"],
            "s",
            T0,
        );
        let got = new.post_envelopes(&f.addr, &[forged]).await.unwrap();
        assert_eq!(got[0].result, "rejected:bad signature");
    }

    #[tokio::test]
    async fn receipts_signed_by_a_retired_key_are_accepted() {
        let f = fx().await;
        let id = testutil::ids().next(T0);
        f.send_to_alpha(&id);
        let receipt = |seq: u64| Receipt {
            v: 1,
            kind: "receipt".into(),
            msg: id.clone(),
            recipient: "ann@alpha".into(),
            state: "read".into(),
            at: agentmbx_protocol::time::iso_ms(T0),
            note: None,
            did: None,
            seq,
        };
        let wire = |seq: u64, key: &HostKey| -> Value {
            serde_json::from_str(&receipt(seq).wire(key).unwrap()).unwrap()
        };
        assert_eq!(f.announce(&[f.rotation()]).await, vec!["rotated"]);
        let accept = |w: &Value, sender: &str| {
            f.store
                .mailbox
                .with(|c| receipts::accept(c, "beta", w, None, Some(sender), T0))
                .unwrap()
        };
        let (old, new) = (b64(&f.alpha_old), b64(&f.alpha_new));
        // Signed and pushed by the retired key before the rotation.
        assert_eq!(accept(&wire(1, &f.alpha_old.host_key), &old), "accepted");
        // Signed by the retired key, pushed by the new one (a receipt signed once, kept).
        assert_eq!(accept(&wire(2, &f.alpha_old.host_key), &new), "accepted");
        assert_eq!(accept(&wire(3, &f.alpha_new.host_key), &new), "accepted");
        // Neither a stranger's push nor a stranger's signature.
        let stranger = HostKey::generate();
        assert_eq!(
            accept(&wire(4, &f.alpha_new.host_key), &stranger.public().to_b64()),
            "rejected:receipt for ann@alpha did not come from alpha"
        );
        assert_eq!(accept(&wire(5, &stranger), &new), "rejected:bad signature");
    }
}
