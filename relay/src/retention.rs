//! The retention sweep as the relay runs it (spec §6, §7; `wire.md` §2.12 "Expiry notice",
//! §3.2 "Sweep").
//!
//! # What it owns
//! - **The notice signer** ([`RelayNoticeSigner`]): the relay key's [`NoticeSigner`], which
//!   turns the facts of an expired envelope into the wire bytes of its notice,
//!   canonical(`{notice, sig}`) with `notice = {v:1, type:"relay-expired", item_id,
//!   target_pubkey, accepted_at, expired_at}` (ISO ms, `Z`) and `sig` the relay key's signature
//!   over canonical(notice). The store decides what expires and queues the notices
//!   ([`OperationsStore::sweep`](crate::store::OperationsStore::sweep)); it never sees the key.
//! - **The schedule** ([`run`]): one sweep at start (so a relay that was down, or a store that
//!   came back from an old copy, settles at once), then one every `sweep_interval_ms`
//!   (default [`DEFAULT_SWEEP_INTERVAL_MS`], 10 min), at the time of the relay's clock. A sweep
//!   is bounded (at most 10,000 items, [`SWEEP_MAX_BATCHES`](crate::store::SWEEP_MAX_BATCHES)
//!   batches); when it stopped at its bounds with work left ([`SweepReport::more`]) the next
//!   one follows after [`CATCH_UP_PAUSE`] (1 s) instead of the interval, for at most
//!   [`MAX_CATCH_UP_SWEEPS`] sweeps in a row ([`Schedule`]), so a backlog of expired items
//!   drains in seconds while other requests keep their turn at the writer between the sweeps.
//!   [`sweep_once`] is one sweep now; tests call it after moving their manual clock.
//! - **The log line**: one `info` line per sweep that changed something, with the counts. The
//!   `relay-sweep` receipt itself is written by the store, in the sweep's last transaction.
//!
//! # What it must never do
//! Log or return key material, item contents or wire bytes; sleep in place of a clock (its
//! time is the relay's [`SharedClock`](agentmbx_protocol::clock::SharedClock)); stop the relay
//! when a sweep fails (the next one continues where it stopped).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use agentmbx_protocol::canonical;
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::records::ExpiryNotice;
use agentmbx_protocol::time::iso_ms;

pub use crate::config::DEFAULT_SWEEP_INTERVAL_MS;
use crate::state::SharedRelay;
use crate::store::{ExpiryFacts, NoticeSigner, StoreError, SweepReport};

/// The item id of the notice about `item_id` pushed to `target_pubkey`:
/// `expired:<item_id>:<target_pubkey>` (`wire.md` §2.12).
pub fn notice_item_id(item_id: &str, target_pubkey: &str) -> String {
    format!("expired:{item_id}:{target_pubkey}")
}

/// The notice record for `facts` (`wire.md` §2.12): times as ISO ms in the `Z` form.
pub fn expiry_notice(facts: &ExpiryFacts) -> ExpiryNotice {
    ExpiryNotice {
        v: 1,
        kind: "relay-expired".to_owned(),
        item_id: facts.item_id.clone(),
        target_pubkey: facts.target_pubkey.clone(),
        accepted_at: iso_ms(facts.accepted_at_ms),
        expired_at: iso_ms(facts.expired_at_ms),
    }
}

/// The notice item's wire bytes: canonical(`{notice, sig}`), `sig` = `key` over
/// canonical(notice) (`wire.md` §2.12). Errors (a record that cannot be serialized) name no key
/// material.
pub fn notice_wire(key: &HostKey, facts: &ExpiryFacts) -> Result<Vec<u8>, String> {
    let notice = serde_json::to_value(expiry_notice(facts))
        .map_err(|e| format!("expiry notice not serializable: {e}"))?;
    let signed = canonical::to_string(&notice).map_err(|e| e.to_string())?;
    let sig = key.sign(signed.as_bytes());
    canonical::to_string(&json!({"notice": notice, "sig": sig}))
        .map(String::into_bytes)
        .map_err(|e| e.to_string())
}

/// The relay key as the store's [`NoticeSigner`]. Its `Debug` shows the key's fingerprint only.
#[derive(Clone)]
pub struct RelayNoticeSigner {
    key: HostKey,
}

impl RelayNoticeSigner {
    /// A signer over the relay key.
    pub fn new(key: HostKey) -> Self {
        Self { key }
    }
}

impl std::fmt::Debug for RelayNoticeSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayNoticeSigner")
            .field("fingerprint", &self.key.public().fingerprint())
            .finish()
    }
}

impl NoticeSigner for RelayNoticeSigner {
    fn relay_pubkey(&self) -> String {
        self.key.public().to_b64()
    }

    fn notice_wire(&self, facts: &ExpiryFacts) -> Result<Vec<u8>, String> {
        notice_wire(&self.key, facts)
    }
}

/// One sweep now (the relay clock's time) over the relay's store, with the relay key as
/// signer; logs the `info` line when it changed something. Errors: the store's (see
/// [`OperationsStore::sweep`](crate::store::OperationsStore::sweep)); [`StoreError::NotCommitted`]
/// when the blocking task died.
pub async fn sweep_once(state: &SharedRelay) -> Result<SweepReport, StoreError> {
    let now = state.clock.now_ms();
    let store = state.store.clone();
    let signer: Arc<dyn NoticeSigner> = Arc::new(RelayNoticeSigner::new(state.key.clone()));
    let hub = state.streams.clone();
    // Each batch's notices go to their targets' push streams once that batch committed (a
    // later batch's error loses none of them).
    let report = tokio::task::spawn_blocking(move || {
        store.sweep_notify(
            now,
            signer,
            Arc::new(move |notices| {
                for n in notices {
                    hub.publish(
                        &n.target_pubkey,
                        &crate::stream::hub::LiveItem {
                            seq: n.seq,
                            prev_seq: n.prev_seq,
                            kind: "expired".to_owned(),
                            item_id: n.item_id.clone(),
                            sender_pubkey: n.sender_pubkey.clone(),
                            wire: bytes::Bytes::copy_from_slice(&n.wire),
                        },
                    );
                }
            }),
        )
    })
    .await
    .map_err(|_| StoreError::NotCommitted {
        reason: "the sweep task failed".to_owned(),
    })??;
    log_report(&report);
    Ok(report)
}

/// The one log line of a sweep (`info` when it changed something, else `debug`).
fn log_report(r: &SweepReport) {
    if r.changed() {
        tracing::info!(
            expired = r.expired_items,
            envelopes = r.expired_envelopes,
            receipts = r.expired_receipts,
            notices_expired = r.expired_notices,
            freed_bytes = r.expired_bytes,
            notices_queued = r.notices,
            senders_not_enrolled = r.notices_not_enrolled,
            senders_over_cap = r.notices_over_cap,
            dedup_pruned = r.pruned_dedup,
            batches = r.batches,
            more = r.more,
            "relay sweep: {} expired item(s) deleted, {} expiry notice(s) queued for senders, {} \
             dedup row(s) past the horizon pruned{}",
            r.expired_items,
            r.notices,
            r.pruned_dedup,
            if r.more {
                "; more left for the next sweep"
            } else {
                ""
            }
        );
    } else {
        tracing::debug!(batches = r.batches, "relay sweep: nothing expired");
    }
}

/// The sweep period of `state`'s configuration.
pub fn interval(state: &SharedRelay) -> Duration {
    Duration::from_millis(
        state
            .config
            .sweep_interval_ms
            .unwrap_or(DEFAULT_SWEEP_INTERVAL_MS),
    )
}

/// The pause before the next sweep when the last one stopped at its bounds with work left
/// ([`SweepReport::more`]): 1 s, so a backlog drains quickly but the writer still serves the
/// requests that queued up meanwhile.
pub const CATCH_UP_PAUSE: Duration = Duration::from_secs(1);

/// The most sweeps in a row that follow each other after [`CATCH_UP_PAUSE`] (100: up to a
/// million expired items, about two minutes); then the schedule waits one interval before it
/// catches up again, so a sweep that can never finish (a store fault) cannot keep the writer
/// busy for ever.
pub const MAX_CATCH_UP_SWEEPS: u32 = 100;

/// When the next sweep runs ([`run`]): after the interval, or after [`CATCH_UP_PAUSE`] while
/// sweeps report work left, at most [`MAX_CATCH_UP_SWEEPS`] times in a row.
#[derive(Debug, Clone)]
pub struct Schedule {
    every: Duration,
    catching_up: u32,
}

impl Schedule {
    /// A schedule with the period `every` (the configured `sweep_interval_ms`).
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            catching_up: 0,
        }
    }

    /// How long to wait after a sweep that reported `more` (work left at its bounds; `false`
    /// for a failed sweep).
    pub fn after(&mut self, more: bool) -> Duration {
        if more && self.catching_up < MAX_CATCH_UP_SWEEPS {
            self.catching_up += 1;
            CATCH_UP_PAUSE.min(self.every)
        } else {
            self.catching_up = 0;
            self.every
        }
    }
}

/// Sweeps now, then every [`interval`] — or after [`CATCH_UP_PAUSE`] while a sweep leaves work
/// for the next ([`Schedule`]) — for ever (the server aborts the task when it stops). A failed
/// sweep is logged (`warn`) and the schedule goes on.
pub async fn run(state: SharedRelay) {
    let mut schedule = Schedule::new(interval(&state));
    loop {
        let more = match sweep_once(&state).await {
            Ok(report) => report.more,
            Err(e) => {
                tracing::warn!(error = %e, "relay sweep failed; the next sweep continues");
                false
            }
        };
        tokio::time::sleep(schedule.after(more)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{DirectoryStore, ItemStore};
    use agentmbx_protocol::keys::PublicKey;
    use agentmbx_protocol::time::parse_iso_ms;

    /// The golden vector `relay_expired_notice` (shared/tests/data/records.json).
    #[test]
    fn the_notice_wire_matches_the_golden_vector() {
        let key =
            HostKey::from_seed_b64("5k8+ALOxfNj13Mt/+05EU475Hq98De8RniSftCuFWBU=").expect("seed");
        assert_eq!(
            key.public().to_b64(),
            "mwYOz9391vn+VassPQwcxrZJ2oX0CFWW7aZRgnVHc5s="
        );
        let facts = ExpiryFacts {
            item_id: "01KDVDND1K20BQNR5GAFG5HETT".to_owned(),
            target_pubkey: "pP8yfu981JgiqEwLyoqI6D7CiA5leQFMwy2TktUDnsE=".to_owned(),
            accepted_at_ms: parse_iso_ms("2026-01-01T00:00:03.173Z").expect("iso"),
            expired_at_ms: parse_iso_ms("2026-01-15T00:01:04.173Z").expect("iso"),
        };
        let signer = RelayNoticeSigner::new(key.clone());
        let wire = String::from_utf8(signer.notice_wire(&facts).expect("wire")).expect("utf8");
        assert_eq!(
            wire,
            "{\"notice\":{\"accepted_at\":\"2026-01-01T00:00:03.173Z\",\"expired_at\":\
             \"2026-01-15T00:01:04.173Z\",\"item_id\":\"01KDVDND1K20BQNR5GAFG5HETT\",\
             \"target_pubkey\":\"pP8yfu981JgiqEwLyoqI6D7CiA5leQFMwy2TktUDnsE=\",\"type\":\
             \"relay-expired\",\"v\":1},\"sig\":\"AW2ndCjptLrDnYDkB7KiHKhZP2BNpfXGQRSHlW8HgaUVEe\
             hc6d0o1SA0I40lvcEqf7zf2zn2buBbI3B5H+XGAA==\"}"
        );
        assert_eq!(
            agentmbx_protocol::hash::sha256_hex(wire.as_bytes()),
            "b51e092ad62fd3a9948e2a5ee3e186151784d49a0c29c0766a8d1b2db42ed8b8"
        );
        assert_eq!(
            notice_item_id(&facts.item_id, &facts.target_pubkey),
            "expired:01KDVDND1K20BQNR5GAFG5HETT:pP8yfu981JgiqEwLyoqI6D7CiA5leQFMwy2TktUDnsE="
        );
        assert_eq!(signer.relay_pubkey(), key.public().to_b64());
        // The signature covers canonical(notice) and nothing else.
        let v: serde_json::Value = serde_json::from_str(&wire).expect("json");
        let signed = canonical::to_string(&v["notice"]).expect("canonical");
        let relay = PublicKey::from_b64(&signer.relay_pubkey()).expect("key");
        assert!(relay.verify(signed.as_bytes(), v["sig"].as_str().expect("sig")));
        let mut changed = v["notice"].clone();
        changed["expired_at"] = json!("2026-01-15T00:01:04.174Z");
        let changed = canonical::to_string(&changed).expect("canonical");
        assert!(!relay.verify(changed.as_bytes(), v["sig"].as_str().expect("sig")));
    }

    #[test]
    fn the_signer_debug_shows_the_fingerprint_only() {
        let key = HostKey::generate();
        let text = format!("{:?}", RelayNoticeSigner::new(key.clone()));
        assert!(text.contains(&key.public().fingerprint()), "{text}");
        assert!(!text.contains(&key.seed_b64_secret()), "{text}");
    }

    #[test]
    fn a_sweep_with_work_left_is_followed_after_a_second_a_bounded_number_of_times() {
        let every = Duration::from_millis(DEFAULT_SWEEP_INTERVAL_MS);
        let mut s = Schedule::new(every);
        assert_eq!(s.after(false), every);
        for _ in 0..MAX_CATCH_UP_SWEEPS {
            assert_eq!(s.after(true), CATCH_UP_PAUSE);
        }
        // Past the bound: one interval, then catching up again.
        assert_eq!(s.after(true), every);
        assert_eq!(s.after(true), CATCH_UP_PAUSE);
        // A sweep that finished (or failed) ends the run.
        assert_eq!(s.after(false), every);
        // Never longer than the interval itself.
        let short = Duration::from_millis(500);
        assert_eq!(Schedule::new(short).after(true), short);
    }

    /// A backlog of more expired items than one sweep takes (10,000) drains in successive
    /// sweeps, the schedule following each sweep that left work after [`CATCH_UP_PAUSE`], not
    /// after the interval.
    #[tokio::test]
    async fn a_backlog_beyond_one_sweep_drains_in_successive_sweeps() {
        use crate::store::{
            Expiry, OpenOptions, PushBatch, PushItem, PushTarget, RelayStore, SqliteStore,
            StoreLimits, DAY_MS, SWEEP_BATCH, SWEEP_MAX_BATCHES,
        };
        use agentmbx_protocol::clock::ManualClock;
        const T0: i64 = 1_800_000_000_000;
        let per_sweep = (SWEEP_BATCH * SWEEP_MAX_BATCHES) as u64;
        let backlog = per_sweep + 100;

        let dir = tempfile::tempdir().expect("dir");
        let key = HostKey::generate();
        let limits = StoreLimits {
            max_queue_items: 2 * backlog,
            max_sender_items: 2 * backlog,
            retention_days: 1,
            ..StoreLimits::default()
        };
        let options = OpenOptions {
            lock_wait_ms: 0,
            limits,
            ..OpenOptions::default()
        };
        let store =
            SqliteStore::open_with(dir.path(), &key.public().to_b64(), T0, options).expect("open");
        let target = HostKey::generate().public().to_b64();
        store
            .enrol(crate::store::EnrolRequest {
                host_pubkey: target.clone(),
                host_name: "beta".into(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".into(),
                strength: crate::store::AuthorityStrength::HostKeyChallenge,
                now_ms: T0,
            })
            .expect("enrol");
        // The sender is not enrolled: no notices, only the expiry itself.
        let sender = HostKey::generate().public().to_b64();
        let ids: Vec<String> = (0..backlog).map(|i| format!("m{i:06}")).collect();
        for chunk in ids.chunks(500) {
            let out = store
                .push(PushBatch {
                    sender_pubkey: sender.clone(),
                    sender_host: "alpha".into(),
                    now_ms: T0,
                    expiry: Expiry::Retention,
                    items: chunk
                        .iter()
                        .map(|id| PushItem {
                            kind: "envelope".into(),
                            item_id: id.clone(),
                            targets: vec![PushTarget {
                                target_pubkey: target.clone(),
                                wire: bytes::Bytes::copy_from_slice(id.as_bytes()),
                            }],
                        })
                        .collect(),
                })
                .expect("push");
            assert!(
                out.items
                    .iter()
                    .all(|i| i.status == crate::store::ItemStatus::Accepted),
                "{:?}",
                out.items.first()
            );
        }
        let store: Arc<dyn RelayStore> = Arc::new(store);
        let clock = Arc::new(ManualClock::new(T0 + DAY_MS));
        let shared: agentmbx_protocol::clock::SharedClock = clock.clone();
        let config = crate::config::RelayConfig::default();
        let authority =
            crate::authority::from_config(&config.authority, shared.clone(), store.clone())
                .expect("authority");
        let state = Arc::new(crate::state::RelayState::new(
            store.clone(),
            key,
            shared,
            config,
            authority,
            crate::ops::store_db(dir.path()),
        ));
        let queued = |_: &Arc<dyn RelayStore>| -> u64 {
            crate::store::raw::one::<i64>(
                &dir.path().join(crate::store::DB_FILE),
                "SELECT COUNT(*) FROM items WHERE target_pubkey = ?1",
                &[target.as_str()],
            )
            .expect("count")
            .try_into()
            .expect("count")
        };
        let mut schedule = Schedule::new(interval(&state));

        let first = sweep_once(&state).await.expect("sweep");
        assert_eq!(first.expired_items, per_sweep);
        assert!(first.more, "{first:?}");
        assert_eq!(schedule.after(first.more), CATCH_UP_PAUSE);
        assert_eq!(queued(&store), backlog - per_sweep);

        let second = sweep_once(&state).await.expect("sweep");
        assert_eq!(second.expired_items, backlog - per_sweep);
        assert!(!second.more, "{second:?}");
        assert_eq!(
            schedule.after(second.more),
            Duration::from_millis(DEFAULT_SWEEP_INTERVAL_MS)
        );
        assert_eq!(queued(&store), 0);
    }

    #[test]
    fn the_sweep_interval_is_checked_at_and_past_its_bounds() {
        use crate::config::{RelayConfig, SWEEP_INTERVAL_MS_RANGE};
        let parse = |ms: u64| {
            RelayConfig::parse(
                &format!("sweep_interval_ms = {ms}\n"),
                std::path::Path::new("relay.toml"),
            )
        };
        let (min, max) = SWEEP_INTERVAL_MS_RANGE;
        for ok in [min, DEFAULT_SWEEP_INTERVAL_MS, max] {
            let cfg = parse(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert_eq!(cfg.sweep_interval_ms, Some(ok));
        }
        for bad in [min - 1, max + 1] {
            let e = parse(bad).expect_err("out of bounds").to_string();
            assert!(
                e.contains(&format!(
                    "sweep_interval_ms must be {min}..={max}, got {bad}"
                )),
                "{e}"
            );
        }
        assert_eq!(RelayConfig::default().sweep_interval_ms, None);
        assert_eq!(DEFAULT_SWEEP_INTERVAL_MS, 600_000);
    }
}
