//! `POST /v2/relay/items` (spec §3; `wire.md` §3.1–§3.2): push items for target host keys.
//!
//! A sender over its push rate (`wire.md` §3.2 "Rate limits": requests per minute per sender
//! key) gets every item `rejected:rate`, before any other check.
//!
//! Per item, checks run in the order the rejection strings are listed in `wire.md` §3.2, each
//! one over every target before the next one, and the first failing one is reported:
//! `bad item id` (1..300 UTF-16 units), `bad kind`, `bad targets` (none, more than
//! `max_targets`, or a `host_pubkey` that is not an Ed25519 key in its canonical padded base64
//! form — every key is stored and matched as that one text), `target not enrolled`,
//! `sender not accepted by target` (these two only for targets this item was not already
//! accepted for: a retry of an accepted item settles by dedup even after its target was revoked
//! or changed its allowlist), `duplicate target`, `bad wire` (not the base64 pattern, or
//! not decodable), `item over size limit`, then `bad wire` again for decoded bytes that are not
//! JSON (0.5.x parses after the size check), `bad envelope: <why>`,
//! `item id is not the envelope id`, `envelope body is not sealed`, `bad receipt` (not a T218
//! `{rec, sig}`), `item id is not the receipt id`, `receipt is not signed by the sending host`;
//! then the store decides, checking the whole item before its first write: dedup first (a target already stored
//! under this item is `duplicate` with its original seq, or `conflict` for other bytes), then,
//! for fresh targets only, enrolment and the allowlist again inside the transaction, and quotas
//! (`quota:<msg>`). Every fresh target is validated before anything is written: an item is
//! stored for all its fresh targets or for none.
//!
//! The store-backed checks (dedup, enrolment, allowlist, quotas) run once, in the writer's
//! transaction. Only an item that fails a content check (`duplicate target` onwards) needs
//! them earlier, to tell whether `target not enrolled` or `sender not accepted by target` comes
//! first; for those items alone the handler reads the store before answering.
//!
//! HTTP 200 means "the results are in this body"; each accepted or duplicate item carries the
//! relay-signed accept statement, sent only after the commit that covers it. Every rejected
//! item is counted by reason and logged at DEBUG ([`crate::refusals`]; admin stats `refused.push`).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::Value;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::limits::{self, MAX_ITEM_ID, RELAY_MAX_BODY};
use agentmbx_protocol::records::{self, AcceptStatement, AcceptTarget};
use agentmbx_protocol::wire::{self, PushRequest, TargetSeq};
use agentmbx_protocol::{b64, canonical, envelope};
use serde_json::value::RawValue;

use crate::auth::{authenticate, blocking, read_body, utf8};
use crate::error::ApiError;
use crate::state::{RelayState, SharedRelay};
use crate::store::{self, Expiry, ItemStatus, PushBatch};

/// A push result as the relay writes it: the accept statement as its canonical text (the bytes it
/// signed), not parsed again into a `Value`.
type PushResult = wire::PushResult<Box<RawValue>>;
type PushResponse = wire::PushResponse<Box<RawValue>>;

fn rejected(item_id: &str, why: &str) -> PushResult {
    PushResult {
        item_id: item_id.to_string(),
        status: format!("rejected:{why}"),
        targets: vec![],
        accept: None,
        sig: None,
    }
}

/// What the store said about one target key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TargetState {
    /// Enrolled, not revoked, and the sender is allowed.
    Ok,
    /// Unknown or revoked.
    NotEnrolled,
    /// The target's sender allowlist does not name the sender.
    NotAccepted,
}

/// The target text as the relay stores it: an Ed25519 key in canonical padded base64.
fn is_canonical_target(text: &str) -> bool {
    crate::auth::parse_key(text).is_some_and(|k| k.to_b64() == text)
}

/// The checks of one item that come before the store-backed ones (`wire.md` §3.2): `bad item
/// id`, `bad kind`, `bad targets`.
fn check_head(state: &RelayState, item: &agentmbx_protocol::wire::PushItem) -> Result<(), String> {
    let id_len = limits::utf16_len(&item.item_id);
    if id_len == 0 || id_len > MAX_ITEM_ID {
        return Err("bad item id".into());
    }
    if item.kind != "envelope" && item.kind != "receipt" {
        return Err("bad kind".into());
    }
    if item.targets.is_empty()
        || item.targets.len() as u64 > state.config.limits.max_targets
        || !item
            .targets
            .iter()
            .all(|t| is_canonical_target(&t.host_pubkey))
    {
        return Err("bad targets".into());
    }
    Ok(())
}

/// The checks of one item that come after the store-backed ones: `duplicate target`, then the
/// wire checks. Returns the decoded target wires in order.
fn check_tail(
    state: &RelayState,
    sender: &PublicKey,
    item: &agentmbx_protocol::wire::PushItem,
) -> Result<Vec<Vec<u8>>, String> {
    if item.targets.iter().enumerate().any(|(i, t)| {
        item.targets[..i]
            .iter()
            .any(|u| u.host_pubkey == t.host_pubkey)
    }) {
        return Err("duplicate target".into());
    }
    check_wires(state, sender, item)
}

/// The first store-backed refusal of an item whose tail checks failed: `target not enrolled`,
/// then `sender not accepted by target`, each over the targets this item was not already
/// accepted for (`settled`, its dedup rows).
fn store_refusal(
    targets: &HashMap<String, TargetState>,
    settled: &HashSet<String>,
    item: &agentmbx_protocol::wire::PushItem,
) -> Option<&'static str> {
    let state = |t: &agentmbx_protocol::wire::PushTarget| {
        if settled.contains(&t.host_pubkey) {
            return TargetState::Ok;
        }
        targets
            .get(&t.host_pubkey)
            .copied()
            .unwrap_or(TargetState::NotEnrolled)
    };
    if item
        .targets
        .iter()
        .any(|t| state(t) == TargetState::NotEnrolled)
    {
        return Some("target not enrolled");
    }
    if item
        .targets
        .iter()
        .any(|t| state(t) == TargetState::NotAccepted)
    {
        return Some("sender not accepted by target");
    }
    None
}

/// Per item id, the targets it was already accepted for (its dedup rows).
type Settled = HashMap<String, HashSet<String>>;

/// For the items whose tail checks failed, `(item_id, target keys)`: which targets each was
/// already accepted for, and the enrolment and allowlist verdict of every other target, read
/// once per key.
fn read_target_states(
    store: &dyn store::RelayStore,
    sender: &str,
    wanted: Vec<(String, Vec<String>)>,
) -> Result<(Settled, HashMap<String, TargetState>), ApiError> {
    let mut settled: Settled = HashMap::new();
    let mut states: HashMap<String, TargetState> = HashMap::new();
    for (item_id, keys) in wanted {
        let done = match settled.entry(item_id) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let done = store.dedup_targets(sender, e.key())?.into_iter().collect();
                e.insert(done)
            }
        };
        for k in keys {
            if done.contains(&k) || states.contains_key(&k) {
                continue;
            }
            let verdict = match store.enrolment(&k)? {
                Some(e) if !e.is_revoked() => match store.sender_list(&k)? {
                    Some(list) if !list.senders.iter().any(|s| s == sender) => {
                        TargetState::NotAccepted
                    }
                    _ => TargetState::Ok,
                },
                _ => TargetState::NotEnrolled,
            };
            states.insert(k, verdict);
        }
    }
    Ok((settled, states))
}

/// The wire checks of one item (`bad wire` onwards), each over every target in turn.
fn check_wires(
    state: &RelayState,
    sender: &PublicKey,
    item: &agentmbx_protocol::wire::PushItem,
) -> Result<Vec<Vec<u8>>, String> {
    if !item.targets.iter().all(|t| b64::is_wire_b64(&t.wire_b64)) {
        return Err("bad wire".into());
    }
    let wires = item
        .targets
        .iter()
        .map(|t| b64::decode(&t.wire_b64))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "bad wire".to_string())?;
    if wires
        .iter()
        .any(|w| w.len() as u64 > state.config.limits.max_item_bytes)
    {
        return Err("item over size limit".into());
    }
    let docs = wires
        .iter()
        .map(|w| canonical::parse(w))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "bad wire".to_string())?;
    if item.kind == "envelope" {
        for env in &docs {
            envelope::check_shape(env).map_err(|why| format!("bad envelope: {why}"))?;
        }
        if docs
            .iter()
            .any(|env| env.get("id").and_then(Value::as_str) != Some(item.item_id.as_str()))
        {
            return Err("item id is not the envelope id".into());
        }
        if docs
            .iter()
            .any(|env| env.get("enc").is_none_or(Value::is_null))
        {
            return Err("envelope body is not sealed".into());
        }
    } else {
        // The full T218 shape first; a record whose only fault is its signature is read for
        // the id check, and refused for the signature after it.
        let verdicts: Vec<_> = wires
            .iter()
            .map(|w| records::parse_receipt_wire(w, sender))
            .collect();
        let recs = verdicts
            .iter()
            .zip(&docs)
            .map(|(verdict, doc)| match verdict {
                Ok(rec) => Some(rec.clone()),
                Err(why) if *why == RECEIPT_BAD_SIGNATURE => receipt_record(doc),
                Err(_) => None,
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| "bad receipt".to_string())?;
        if recs.iter().any(|rec| rec.item_id() != item.item_id) {
            return Err("item id is not the receipt id".into());
        }
        if verdicts.iter().any(Result::is_err) {
            return Err("receipt is not signed by the sending host".into());
        }
    }
    Ok(wires)
}

/// `records::parse_receipt_wire`'s reason for a well-formed record whose signature fails.
const RECEIPT_BAD_SIGNATURE: &str = "bad signature";

/// The `rec` of a receipt wire whose shape `records::parse_receipt_wire` already accepted.
fn receipt_record(doc: &Value) -> Option<records::Receipt> {
    serde_json::from_value(doc.get("rec")?.clone()).ok()
}

/// A push body that does not parse, described without echoing any of it.
fn bad_batch(e: &serde_json::Error) -> ApiError {
    let what = match e.classify() {
        serde_json::error::Category::Data => "wrong shape",
        _ => "invalid JSON",
    };
    ApiError::new(
        StatusCode::BAD_REQUEST,
        format!(
            "bad batch: {{items:[{{kind, item_id, targets:[{{host_pubkey, wire_b64}}]}}]}} \
             required ({what} at line {}, column {})",
            e.line(),
            e.column()
        ),
        "BAD_BATCH",
    )
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
    let push: PushRequest = serde_json::from_str(raw).map_err(|e| bad_batch(&e))?;
    if push.items.len() as u64 > state.config.limits.max_batch {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "more than {} items in one push",
                state.config.limits.max_batch
            ),
            "BAD_BATCH",
        ));
    }
    // Pushes per sender key (`wire.md` §3.2 "Rate limits"): one hit per request; past the
    // limit every item is `rejected:rate` and nothing is looked at or stored.
    if !state
        .rates
        .allow_push(&caller.host_pubkey, state.clock.now_ms())
    {
        let results: Vec<PushResult> = push
            .items
            .iter()
            .map(|item| rejected(&item.item_id, "rate"))
            .collect();
        count_refused(&state, &caller.host_pubkey, &results);
        return Ok(Json(PushResponse { results }));
    }
    let sender = crate::auth::parse_key(&caller.host_pubkey).ok_or_else(ApiError::bad_hop)?;

    let mut results: Vec<Option<PushResult>> = Vec::with_capacity(push.items.len());
    let mut to_store = Vec::new();
    let mut positions = Vec::new();
    // Items that failed a tail check, with that check's reason: answered after the store says
    // whether an earlier, store-backed check fails first.
    let mut refused_late: Vec<(usize, String)> = Vec::new();
    for (idx, item) in push.items.iter().enumerate() {
        results.push(None);
        if let Err(why) = check_head(&state, item) {
            results[idx] = Some(rejected(&item.item_id, &why));
            continue;
        }
        match check_tail(&state, &sender, item) {
            Err(why) => refused_late.push((idx, why)),
            Ok(wires) => {
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
                            wire: wire.into(),
                        })
                        .collect(),
                });
            }
        }
    }

    if !refused_late.is_empty() {
        let wanted: Vec<(String, Vec<String>)> = refused_late
            .iter()
            .map(|(idx, _)| {
                let item = &push.items[*idx];
                let keys = item.targets.iter().map(|t| t.host_pubkey.clone()).collect();
                (item.item_id.clone(), keys)
            })
            .collect();
        let store = state.store.clone();
        let me = caller.host_pubkey.clone();
        let (settled, target_states) =
            blocking(move || Ok(read_target_states(store.as_ref(), &me, wanted))).await??;
        let none_settled = HashSet::new();
        for (idx, why) in refused_late {
            let item = &push.items[idx];
            let done = settled.get(&item.item_id).unwrap_or(&none_settled);
            let why = store_refusal(&target_states, done, item).map_or(why, str::to_owned);
            results[idx] = Some(rejected(&item.item_id, &why));
        }
    }

    if !to_store.is_empty() {
        // Handles on the wire bytes (not copies), to publish on the targets' push streams
        // once the batch committed.
        let wires: Vec<(String, Vec<bytes::Bytes>)> = to_store
            .iter()
            .map(|i| {
                let w = i.targets.iter().map(|t| t.wire.clone()).collect();
                (i.kind.clone(), w)
            })
            .collect();
        let batch = PushBatch {
            sender_pubkey: caller.host_pubkey.clone(),
            sender_host: caller.host_name.clone(),
            now_ms: state.clock.now_ms(),
            expiry: Expiry::Retention,
            items: to_store,
        };
        // The writer answers through the channel after its commit; no thread waits for it.
        // The live frames are published by the same callback, right after the commit and in
        // commit order, whether or not this request is still there to read the answer.
        let (done, answer) = tokio::sync::oneshot::channel();
        let hub = state.streams.clone();
        let sender = caller.host_pubkey.clone();
        state.store.push_then(
            batch,
            Box::new(move |r| {
                if let Ok(outcome) = &r {
                    // Committed whatever happens here: a panic while publishing costs the
                    // live frames (the receivers pull), never the answer.
                    let call = std::panic::AssertUnwindSafe(|| {
                        publish(&hub, &sender, &outcome.items, &wires);
                    });
                    if std::panic::catch_unwind(call).is_err() {
                        tracing::error!("publishing a committed push to the streams panicked");
                    }
                }
                // The request may have gone away (client closed); nobody else to tell.
                let _ = done.send(r);
            }),
        );
        let outcome = answer
            .await
            .map_err(|_| ApiError::from(store::StoreError::WriterStopped))??;
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
                    let signed = accept.canonical();
                    let sig = state.key.sign(signed.as_bytes());
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
                        accept: RawValue::from_string(signed).ok(),
                        sig: Some(sig),
                    }
                }
            };
            results[pos] = Some(result);
        }
    }
    let results: Vec<PushResult> = results
        .into_iter()
        .zip(push.items.iter())
        .map(|(r, item)| r.unwrap_or_else(|| rejected(&item.item_id, "internal")))
        .collect();
    count_refused(&state, &caller.host_pubkey, &results);
    Ok(Json(PushResponse { results }))
}

/// Publishes every target an accepted item was stored for fresh by this push (its entry in
/// `prev_seqs` is set) on that target's push stream ([`crate::stream::hub::Hub::publish`], never waits).
/// A duplicate stored nothing and is not published again. Called by the store's commit callback
/// only (after the commit, in commit order; it must not block).
fn publish(
    hub: &crate::stream::hub::Hub,
    sender_pubkey: &str,
    outcomes: &[store::ItemOutcome],
    wires: &[(String, Vec<bytes::Bytes>)],
) {
    for (out, (kind, item_wires)) in outcomes.iter().zip(wires) {
        if out.status != ItemStatus::Accepted {
            continue;
        }
        for ((t, prev_seq), wire) in out.targets.iter().zip(&out.prev_seqs).zip(item_wires) {
            let Some(prev_seq) = *prev_seq else {
                continue;
            };
            hub.publish(
                &t.target_pubkey,
                &crate::stream::hub::LiveItem {
                    seq: t.seq,
                    prev_seq,
                    kind: kind.clone(),
                    item_id: out.item_id.clone(),
                    sender_pubkey: sender_pubkey.to_owned(),
                    wire: wire.clone(),
                },
            );
        }
    }
}

/// Counts every `rejected:<why>` result of a push answer by its reason and logs each at DEBUG
/// ([`crate::refusals::Refusals::push`]): one pass over the answer, whatever check refused the
/// item (rate, content, store). Costs nothing but the scan when nothing was refused.
fn count_refused(state: &RelayState, sender_pubkey: &str, results: &[PushResult]) {
    let mut sender_fp = None;
    for r in results {
        if let Some(why) = r.status.strip_prefix("rejected:") {
            let fp = sender_fp.get_or_insert_with(|| {
                crate::auth::parse_key(sender_pubkey).map_or_else(String::new, |k| k.fingerprint())
            });
            state.refused.push(why, &r.item_id, fp);
        }
    }
}
