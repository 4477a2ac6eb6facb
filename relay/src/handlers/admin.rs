//! The operator endpoints of a running relay (design README "One process writes a store"):
//! `relay revoke` and `relay deny` for a relay that holds its store, guarded by the admin bearer
//! token (`admin_token_file` in `relay.toml` or `MBX_RELAY_ADMIN_TOKEN`). The work is
//! [`crate::admin`], the same code the offline commands run.
//!
//! | Method path | Request | Success |
//! |---|---|---|
//! | POST /v2/relay/admin/revoke | `{host}` (key or fingerprint) | `{ok:true, newly_revoked, host:{host_pubkey, fingerprint, host_name, account, revoked_at_ms}}` |
//! | POST /v2/relay/admin/deny | `{target, kind?:"host"\|"client", until_ms?}` | `{ok:true, entry:{kind, value, until, at, active}}` |
//! | GET /v2/relay/admin/deny | — | `{entries:[…]}` |
//! | POST /v2/relay/admin/undeny | `{target, kind?}` | `{ok:true, removed, kind, value}` |
//! | POST /v2/relay/admin/rotate-epoch | `{}` | the receipt `{v:1, type:"relay-epoch-rotated", at, store, from, to, by:"operator"}` |
//! | POST /v2/relay/admin/backup-receipt | `{receipt}` (a `relay-backup` receipt of this relay's store, [`crate::ops::check_backup_receipt`]) | `{ok:true, id, receipt}` (its relay-log id, and the receipt as logged: signed by the relay key) |
//! | GET /v2/relay/admin/stats | — | `{write_requests, groups, commits, queued, refused, instance_conflicts, streams}`: the store writer's counters since the relay started ([`crate::store::StoreStats`]; `commits` is the number of fsynced group transactions, so accepted items ÷ commits is items per fsync) and `refused: {push: {<reason>: n}, auth: {<reason>: n}}`, refusals by reason since the relay started (table below), `instance_conflicts: {detected, active}`, the host keys seen used by two daemons at once ([`crate::instances`]), and `streams: {open, running, opened, lagged, dropped_frames, queued_bytes, budget_bytes, closes: {<code>: n}}`, the push streams ([`crate::stream::hub`]); 404 `NOT_FOUND` for a store that keeps none |
//!
//! `refused` ([`crate::refusals`]) lists every key, 0 when it never happened; the counters live
//! in the running relay's memory only (`relay status` reads the store and cannot show them).
//! Each counted refusal is also logged at DEBUG, with at most a key's fingerprint prefix.
//! Signed `GET /v2/relay/info` refuses nothing (a hop that fails a check gets the answer
//! without `you`), so it counts in no `refused.auth` key.
//!
//! | `refused.push.<key>` (items) | rejection on the wire (`rejected:<why>`, `wire.md` §3.2) |
//! |---|---|
//! | `rate_limit` | `rate` (the sender's push rate; every item of the request) |
//! | `bad_item_id`, `bad_kind`, `bad_targets` | `bad item id`, `bad kind`, `bad targets` |
//! | `target_not_enrolled` | `target not enrolled` (unknown or revoked target) |
//! | `sender_not_accepted` | `sender not accepted by target` (the target's allowlist) |
//! | `duplicate_target` | `duplicate target` |
//! | `bad_wire`, `over_size_limit` | `bad wire`, `item over size limit` |
//! | `bad_envelope`, `envelope_id_mismatch`, `not_sealed` | `bad envelope: <why>`, `item id is not the envelope id`, `envelope body is not sealed` |
//! | `bad_receipt`, `receipt_id_mismatch`, `receipt_not_signed` | `bad receipt`, `item id is not the receipt id`, `receipt is not signed by the sending host` |
//! | `conflict` | `conflict` (same sender, item id and target stored with other bytes) |
//! | `quota_queue_depth`, `quota_queue_bytes`, `quota_sender_share`, `quota_owner_queue_depth`, `quota_owner_queue_bytes` | `quota:<which> exceeded for <host>` |
//! | `other` | `internal`, or anything else |
//!
//! | `refused.auth.<key>` (requests) | answer |
//! |---|---|
//! | `missing_header`, `bad_timestamp`, `bad_key` | 401 `BAD_HOP`: a hop header missing, `x-mbx-ts` not decimal ms, `x-mbx-key` not an Ed25519 key |
//! | `stale_timestamp`, `bad_signature` | 401 `BAD_HOP`: `x-mbx-ts` outside ±300 s, a signature that does not verify |
//! | `not_enrolled`, `revoked`, `denied` | 401 `NOT_ENROLLED`, 403 `REVOKED`, 403 `DENIED` |
//! | `token_required`, `bad_token`, `no_account_binding` | account relay: 401 `TOKEN_REQUIRED`, `BAD_TOKEN`, `NOT_ENROLLED` (key enrolled without an account token) |
//! | `admin_token` | 401 `ADMIN_TOKEN` on an admin route |
//! | `no_challenge`, `bad_enrol_signature`, `authority_denied` | `POST /v1/relay/enrol`: 401 `NO_CHALLENGE`, 401 `BAD_SIGNATURE`, 403 `DENIED` by the enrolment authority (an enrolment of a revoked or deny-listed key counts as `revoked`, `denied`) |
//! | `bad_list_signature` | `POST /v2/relay/senders`: 401 `BAD_SIGNATURE` |
//! | `bad_nonce` | `GET /v2/relay/stream`: 401 `BAD_NONCE` |
//!
//! `backup-receipt` exists because `relay backup` copies the store from its own process (a
//! read-only connection, allowed while the relay serves) but only the relay may write its
//! store: the CLI hands the receipt over to be appended to the relay log.
//!
//! Guard: with no admin token configured every admin route answers 404 `{error:"not found"}`,
//! as if it did not exist; without `Authorization: Bearer <token>`, or with another token, 401
//! `{error:"admin token required", code:"ADMIN_TOKEN"}`. The token is compared in constant
//! time and never logged; a refusal is logged at WARN at most once a minute per client
//! address. Every admin route is rate-limited per client address
//! ([`crate::ratelimit::ADMIN_PER_MIN`] a minute, 429 `RATE_LIMIT` past it). Refusals: 400 `BAD_REQUEST`, 404 `NOT_FOUND` (no such enrolment), 409
//! `AMBIGUOUS` with `matches` (a fingerprint of several enrolments), 507 `FULL` (deny-list).

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::stream::close;

use crate::admin::{self, AdminError};
use crate::auth::{read_body, utf8};
use crate::error::ApiError;
use crate::ratelimit::client_address;
use crate::state::SharedRelay;
use crate::store::DenyKind;

/// An admin refusal: a status and its JSON body `{error, code[, matches]}`.
#[derive(Debug)]
pub struct Refusal(StatusCode, Value);

impl From<ApiError> for Refusal {
    fn from(e: ApiError) -> Self {
        Refusal(e.status, json!(e.body))
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

/// 404 when no admin token is configured, 401 unless the request carries it. A refusal is
/// logged at WARN at most once a minute per client address, else at DEBUG.
fn guard(state: &SharedRelay, req: &Request) -> Result<(), Refusal> {
    let Some(token) = &state.config.admin_token else {
        return Err(ApiError::not_found().into());
    };
    let headers = req.headers();
    let presented = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    match presented {
        Some(t) if token.matches(t) => Ok(()),
        _ => {
            let socket = req
                .extensions()
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0);
            let address = client_address(headers, socket, state.rates.trust_proxy);
            let gate = &state.rates.warn_gate;
            state.refused.auth(
                crate::refusals::AuthRefusal::AdminToken,
                req.method().as_str(),
                req.uri().path(),
                None,
            );
            if gate.warn(&format!("admin-token:{address}"), state.clock.now_ms()) {
                tracing::warn!(client = %address, "admin request refused: missing or wrong admin token (further refusals from this address in the next minute are logged at debug)");
            } else {
                tracing::debug!(client = %address, "admin request refused: missing or wrong admin token");
            }
            Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "admin token required",
                "ADMIN_TOKEN",
            )
            .into())
        }
    }
}

fn refusal(e: AdminError) -> Refusal {
    let (status, code) = match &e {
        AdminError::Invalid(_) => (StatusCode::BAD_REQUEST, "BAD_REQUEST"),
        AdminError::NotFound(_) => (StatusCode::NOT_FOUND, "NOT_FOUND"),
        AdminError::Ambiguous { .. } => (StatusCode::CONFLICT, "AMBIGUOUS"),
        AdminError::Full => (StatusCode::INSUFFICIENT_STORAGE, "FULL"),
        AdminError::Store(_)
        | AdminError::NoStore(_)
        | AdminError::Running(_)
        | AdminError::RelayKey(_) => {
            tracing::error!(error = %e, "admin request failed in the store");
            return ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "relay store unavailable",
                "STORE",
            )
            .into();
        }
    };
    let mut body = json!({"error": e.to_string(), "code": code});
    if let AdminError::Ambiguous { matches, .. } = &e {
        body["matches"] = json!(matches);
    }
    Refusal(status, body)
}

/// Runs an admin operation off the runtime.
async fn run<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, AdminError> + Send + 'static,
) -> Result<T, Refusal> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(refusal),
        Err(_) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "relay task failed",
            "INTERNAL",
        )
        .into()),
    }
}

/// The guard, then a small JSON body read into `T` (400 when it is not one).
async fn guarded_body<T: serde::de::DeserializeOwned>(
    state: &SharedRelay,
    req: Request,
) -> Result<T, Refusal> {
    guard(state, &req)?;
    let bytes = read_body(req.into_body(), RELAY_SMALL_BODY).await?;
    serde_json::from_str(utf8(&bytes)?)
        .map_err(|_| ApiError::bad_request("bad admin request body").into())
}

fn kind(text: Option<&str>) -> Result<Option<DenyKind>, Refusal> {
    match text {
        None => Ok(None),
        Some(k) => DenyKind::parse(k)
            .map(Some)
            .ok_or_else(|| ApiError::bad_request("kind must be \"host\" or \"client\"").into()),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RevokeBody {
    host: String,
}

/// `POST /v2/relay/admin/revoke {host}`.
pub async fn revoke(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<Value>, Refusal> {
    let b: RevokeBody = guarded_body(&state, req).await?;
    let (store, now) = (state.store.clone(), state.clock.now_ms());
    let streams = state.streams.clone();
    let r = run(move || {
        let r = admin::revoke(store.as_ref(), &b.host, now)?;
        // Committed: the key's push stream, if one is open, closes (4403). Here, on the
        // blocking thread, so that it happens even when this request is dropped meanwhile.
        streams.close_key(&r.host.host_pubkey, close::AUTH);
        Ok(r)
    })
    .await?;
    Ok(Json(
        json!({"ok": true, "newly_revoked": r.newly_revoked, "host": r.host}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DenyBody {
    target: String,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    until_ms: Option<i64>,
}

/// `POST /v2/relay/admin/deny {target, kind?, until_ms?}`.
pub async fn deny(State(state): State<SharedRelay>, req: Request) -> Result<Json<Value>, Refusal> {
    let b: DenyBody = guarded_body(&state, req).await?;
    let k = kind(b.kind.as_deref())?;
    let (store, now) = (state.store.clone(), state.clock.now_ms());
    let streams = state.streams.clone();
    let e = run(move || {
        let e = admin::deny(store.as_ref(), &b.target, k, b.until_ms, now)?;
        // Committed: close the push streams the entry matches (by its kind), 4403. Here, on
        // the blocking thread, so that it happens even when this request is dropped meanwhile.
        if e.is_active(now) {
            let n = match e.kind {
                DenyKind::Host => streams.close_where(close::AUTH, |s| s.fingerprint == e.value),
                DenyKind::Client => {
                    streams.close_where(close::AUTH, |s| s.client_id.as_deref() == Some(&e.value))
                }
            };
            if n > 0 {
                tracing::info!(streams = n, "push streams closed by a deny entry");
            }
        }
        Ok(e)
    })
    .await?;
    Ok(Json(
        json!({"ok": true, "entry": admin::DenyView::of(&e, now)}),
    ))
}

/// `GET /v2/relay/admin/deny`.
pub async fn deny_list(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<Value>, Refusal> {
    guard(&state, &req)?;
    let (store, now) = (state.store.clone(), state.clock.now_ms());
    let entries = run(move || admin::deny_list(store.as_ref(), now)).await?;
    Ok(Json(json!({ "entries": entries })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UndenyBody {
    target: String,
    #[serde(default)]
    kind: Option<String>,
}

/// `POST /v2/relay/admin/undeny {target, kind?}`.
pub async fn undeny(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<Value>, Refusal> {
    let b: UndenyBody = guarded_body(&state, req).await?;
    let k = kind(b.kind.as_deref())?;
    let (store, now) = (state.store.clone(), state.clock.now_ms());
    let (kind, value, removed) =
        run(move || admin::undeny(store.as_ref(), &b.target, k, now)).await?;
    Ok(Json(
        json!({"ok": true, "removed": removed, "kind": kind.as_str(), "value": value}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateEpochBody {}

/// `POST /v2/relay/admin/rotate-epoch {}`: a new epoch now (`wire.md` §3.4); answers the
/// receipt, already in the relay log.
pub async fn rotate_epoch(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<Value>, Refusal> {
    let RotateEpochBody {} = guarded_body(&state, req).await?;
    let (store, now) = (state.store.clone(), state.clock.now_ms());
    let store_db = state.store_db.clone();
    let streams = state.streams.clone();
    let receipt = run(move || {
        // One rotation at a time from commit to announcement: announced in commit order.
        let _turn = streams.epoch_turn();
        crate::ops::rotate_epoch_then(
            store.as_ref(),
            &store_db,
            crate::ops::RotatedBy::Operator,
            now,
            // Committed: every open stream hears the new epoch (the rotation's own `to`) and
            // resumes in it; here, so that it happens even when this request is dropped.
            |rotation| streams.announce_epoch(&rotation.to),
        )
        .map_err(AdminError::from)
    })
    .await?;
    Ok(Json(receipt))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BackupReceiptBody {
    receipt: Value,
}

/// `POST /v2/relay/admin/backup-receipt {receipt}`: appends a `relay backup` receipt of this
/// relay's store to the relay log; 400 when it is not one.
pub async fn backup_receipt(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<Value>, Refusal> {
    let b: BackupReceiptBody = guarded_body(&state, req).await?;
    crate::ops::check_backup_receipt(&b.receipt, &state.key.public().fingerprint())
        .map_err(|e| Refusal::from(ApiError::bad_request(&e)))?;
    let (store, now) = (state.store.clone(), state.clock.now_ms());
    let (id, logged) = run(move || {
        let id = store
            .append_op(now, crate::ops::OP_BACKUP, &b.receipt)
            .map_err(AdminError::from)?;
        let logged = store
            .ops(16)
            .map_err(AdminError::from)?
            .into_iter()
            .find(|o| o.id == id)
            .map(|o| o.receipt);
        Ok((id, logged))
    })
    .await?;
    Ok(Json(json!({"ok": true, "id": id, "receipt": logged})))
}

/// `GET /v2/relay/admin/stats`: the store writer's counters since the relay started
/// (`{write_requests, groups, commits, queued}`, [`crate::store::StoreStats`]), `refused`,
/// the refusals by reason since the relay started (`{push: {<reason>: n}, auth: {<reason>: n}}`,
/// every key of [`crate::refusals`] listed), and `instance_conflicts: {detected, active}` (two
/// daemons on one host key: detections since the start, keys reported now;
/// [`crate::instances::InstanceStats`]), and `streams` (the push streams: `{open, running,
/// opened, lagged, dropped_frames, queued_bytes, budget_bytes, closes: {<code>: n}}`,
/// [`crate::stream::hub::Hub::stats`]); 404 `NOT_FOUND` when the store keeps none. Reads
/// atomics and memory only: it never touches the database.
pub async fn stats(State(state): State<SharedRelay>, req: Request) -> Result<Json<Value>, Refusal> {
    guard(&state, &req)?;
    let Some(s) = state.store.writer_stats() else {
        return Err(ApiError::not_found().into());
    };
    Ok(Json(json!({
        "write_requests": s.write_requests,
        "groups": s.groups,
        "commits": s.commits,
        "queued": s.queued,
        "refused": state.refused.to_json(),
        "instance_conflicts": state.instances.stats(),
        "streams": state.streams.stats(),
    })))
}
