//! `POST /v2/relay/items` (spec §3; `wire.md` §3.1–§3.2): push items for target host keys.
//!
//! Per item, checks run in the order the rejection strings are listed in `wire.md` §3.2 and
//! the first failing one is reported: `bad item id`, `bad kind`, `bad targets`,
//! `target not enrolled`, `sender not accepted by target`, `duplicate target`, `bad wire`,
//! `item over size limit`, `bad envelope: <why>`, `item id is not the envelope id`,
//! `envelope body is not sealed`, `bad receipt`, `item id is not the receipt id`,
//! `receipt is not signed by the sending host`; then the store decides in the item's own
//! savepoint: dedup (`conflict`) and quotas (`quota:<msg>`), re-checking enrolment and the
//! allowlist inside the transaction. Every target is validated before anything is written: an
//! item is stored for all its targets or for none.
//!
//! HTTP 200 means "the results are in this body"; each accepted or duplicate item carries the
//! relay-signed accept statement, sent only after the commit that covers it.

use axum::extract::{Request, State};
use axum::Json;
use serde_json::Value;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::limits::{MAX_ITEM_ID, RELAY_MAX_BODY};
use agentmbx_protocol::records::{self, AcceptStatement, AcceptTarget};
use agentmbx_protocol::wire::{PushRequest, PushResponse, PushResult, TargetSeq};
use agentmbx_protocol::{b64, canonical, envelope};

use crate::auth::{authenticate, blocking, read_body, utf8};
use crate::error::ApiError;
use crate::server::{RelayState, SharedRelay};
use crate::store::{self, Expiry, ItemStatus, PushBatch};

fn rejected(item_id: &str, why: &str) -> PushResult {
    PushResult {
        item_id: item_id.to_string(),
        status: format!("rejected:{why}"),
        targets: vec![],
        accept: None,
        sig: None,
    }
}

/// Validates one wire item that needs no store access (`bad wire` onwards). Returns the decoded
/// target wires in order.
fn check_wires(
    state: &RelayState,
    sender: &PublicKey,
    item: &agentmbx_protocol::wire::PushItem,
) -> Result<Vec<Vec<u8>>, String> {
    let mut wires = Vec::with_capacity(item.targets.len());
    for t in &item.targets {
        if !b64::is_wire_b64(&t.wire_b64) {
            return Err("bad wire".into());
        }
        let wire = b64::decode(&t.wire_b64).map_err(|_| "bad wire".to_string())?;
        if wire.len() as u64 > state.config.limits.max_item_bytes {
            return Err("item over size limit".into());
        }
        wires.push(wire);
    }
    for wire in &wires {
        if item.kind == "envelope" {
            let env = canonical::parse(wire).map_err(|_| "bad envelope: not JSON".to_string())?;
            envelope::check_shape(&env).map_err(|why| format!("bad envelope: {why}"))?;
            if env.get("id").and_then(Value::as_str) != Some(item.item_id.as_str()) {
                return Err("item id is not the envelope id".into());
            }
            if env.get("enc").is_none_or(Value::is_null) {
                return Err("envelope body is not sealed".into());
            }
        } else {
            let rec = parse_receipt_unsigned(wire).ok_or_else(|| "bad receipt".to_string())?;
            if rec.item_id() != item.item_id {
                return Err("item id is not the receipt id".into());
            }
            records::parse_receipt_wire(wire, sender)
                .map_err(|_| "receipt is not signed by the sending host".to_string())?;
        }
    }
    Ok(wires)
}

/// Shape of a receipt wire without its signature check (to order the refusals).
fn parse_receipt_unsigned(wire: &[u8]) -> Option<records::Receipt> {
    let v = canonical::parse(wire).ok()?;
    let obj = v.as_object()?;
    if obj.len() != 2 || !obj.get("sig").is_some_and(Value::is_string) {
        return None;
    }
    let rec: records::Receipt = serde_json::from_value(obj.get("rec")?.clone()).ok()?;
    (rec.v == 1 && rec.kind == "receipt" && rec.seq >= 1).then_some(rec)
}

/// Handles `POST /v2/relay/items`.
pub async fn post(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<PushResponse>, ApiError> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, RELAY_MAX_BODY).await?;
    let raw = utf8(&body)?;
    let caller = authenticate(&state, &parts.method, &parts.uri, &parts.headers, raw).await?;
    let push: PushRequest = serde_json::from_str(raw).map_err(|e| {
        ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            format!("bad batch: {e}"),
            "BAD_BATCH",
        )
    })?;
    if push.items.len() as u64 > state.config.limits.max_batch {
        return Err(ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            format!(
                "more than {} items in one push",
                state.config.limits.max_batch
            ),
            "BAD_BATCH",
        ));
    }
    let sender = PublicKey::from_b64(&caller.host_pubkey).map_err(|_| ApiError::bad_hop())?;
    // Store-backed target checks, read once for every target named in the batch.
    let keys: Vec<String> = push
        .items
        .iter()
        .flat_map(|i| i.targets.iter().map(|t| t.host_pubkey.clone()))
        .collect();
    let store = state.store.clone();
    let me = caller.host_pubkey.clone();
    let target_ok: std::collections::HashMap<String, Result<(), &'static str>> =
        blocking(move || {
            let mut m = std::collections::HashMap::new();
            for k in keys {
                if m.contains_key(&k) {
                    continue;
                }
                let verdict = match store.enrolment(&k)? {
                    Some(e) if !e.is_revoked() => match store.sender_list(&k)? {
                        Some(list) if !list.senders.iter().any(|s| s == &me) => {
                            Err("sender not accepted by target")
                        }
                        _ => Ok(()),
                    },
                    _ => Err("target not enrolled"),
                };
                m.insert(k, verdict);
            }
            Ok(m)
        })
        .await?;

    let mut results: Vec<Option<PushResult>> = Vec::with_capacity(push.items.len());
    let mut to_store = Vec::new();
    let mut positions = Vec::new();
    for (idx, item) in push.items.iter().enumerate() {
        let id_len = item.item_id.chars().count();
        let verdict: Result<Vec<Vec<u8>>, String> = if id_len == 0 || id_len > MAX_ITEM_ID {
            Err("bad item id".into())
        } else if item.kind != "envelope" && item.kind != "receipt" {
            Err("bad kind".into())
        } else if item.targets.is_empty()
            || item.targets.len() as u64 > state.config.limits.max_targets
        {
            Err("bad targets".into())
        } else if let Some(why) = item
            .targets
            .iter()
            .find_map(|t| target_ok.get(&t.host_pubkey).and_then(|v| v.err()))
        {
            Err(why.into())
        } else if item.targets.iter().enumerate().any(|(i, t)| {
            item.targets[..i]
                .iter()
                .any(|u| u.host_pubkey == t.host_pubkey)
        }) {
            Err("duplicate target".into())
        } else {
            check_wires(&state, &sender, item)
        };
        match verdict {
            Err(why) => results.push(Some(rejected(&item.item_id, &why))),
            Ok(wires) => {
                results.push(None);
                positions.push(idx);
                to_store.push(store::PushItem {
                    kind: item.kind.clone(),
                    item_id: item.item_id.clone(),
                    targets: item
                        .targets
                        .iter()
                        .zip(wires)
                        .map(|(t, wire)| store::PushTarget {
                            target_pubkey: t.host_pubkey.clone(),
                            wire,
                        })
                        .collect(),
                });
            }
        }
    }

    if !to_store.is_empty() {
        let batch = PushBatch {
            sender_pubkey: caller.host_pubkey.clone(),
            sender_host: caller.host_name.clone(),
            now_ms: state.clock.now_ms(),
            expiry: Expiry::Retention,
            items: to_store,
        };
        let store = state.store.clone();
        let outcome = blocking(move || store.push(batch)).await?;
        let relay_pubkey = state.key.public().to_b64();
        for (pos, out) in positions.into_iter().zip(outcome.items) {
            let result = match &out.status {
                ItemStatus::Rejected(r) => rejected(&out.item_id, &r.code()),
                status => {
                    let accept = AcceptStatement {
                        v: 1,
                        kind: "relay-accept".into(),
                        relay_pubkey: relay_pubkey.clone(),
                        epoch: outcome.epoch.clone(),
                        sender_pubkey: caller.host_pubkey.clone(),
                        item_id: out.item_id.clone(),
                        targets: out
                            .targets
                            .iter()
                            .map(|t| AcceptTarget {
                                host_pubkey: t.target_pubkey.clone(),
                                seq: t.seq,
                                wire_hash: t.wire_hash.clone(),
                            })
                            .collect(),
                        at: agentmbx_protocol::time::iso_ms(out.at_ms.unwrap_or(0)),
                    };
                    let sig = accept.sign(&state.key);
                    PushResult {
                        item_id: out.item_id.clone(),
                        status: status.wire(),
                        targets: out
                            .targets
                            .iter()
                            .map(|t| TargetSeq {
                                host_pubkey: t.target_pubkey.clone(),
                                seq: t.seq,
                            })
                            .collect(),
                        accept: serde_json::to_value(&accept).ok(),
                        sig: Some(sig),
                    }
                }
            };
            results[pos] = Some(result);
        }
    }
    let results = results
        .into_iter()
        .zip(push.items.iter())
        .map(|(r, item)| r.unwrap_or_else(|| rejected(&item.item_id, "internal")))
        .collect();
    Ok(Json(PushResponse { results }))
}
