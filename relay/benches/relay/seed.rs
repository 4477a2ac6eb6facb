//! Seeds deep queues into a relay store directory while no relay runs on it.
//!
//! The first [`API_ITEMS`] items of each queue go through the store's public API
//! (`SqliteStore::push`, one batch of fresh sealed envelopes per call: what a push request
//! does, minus HTTP). The rest are written with plain INSERTs in the store's own schema (the
//! `items`, `dedup` and `seqs` rows `push` writes, same sequence rule), [`SQL_BATCH`] items per
//! transaction: `push` checks the queue quota with `COUNT(*)`/`SUM(bytes)` over the target's
//! queue, a cost that grows with the depth, so a million-item queue cannot be seeded through it
//! in reasonable time. Those rows reuse a pool of real sealed envelopes under fresh item ids:
//! the relay never parses a wire on the pull path, and the pulled bytes have the same size.
//! Finally the store is opened again through the API (a consistency check) and its heartbeat
//! written, so the relay does not rotate the epoch at start.

use std::path::Path;
use std::time::Instant;

use rusqlite::params;

use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::ulid;

use agentmbx_relay::store::{
    self, AuthorityStrength, DirectoryStore, EnrolOutcome, EnrolRequest, Expiry, ItemStatus,
    ItemStore, OpenOptions, PushBatch, PushItem, PushTarget, SqliteStore, StoreHealth, StoreLimits,
};

use super::{now_ms, sealed, Host, Res};

/// Items per queue pushed through `SqliteStore::push`.
pub const API_ITEMS: usize = 1_000;

/// Items per `push` call on the API path.
const API_BATCH: usize = 500;

/// Items per transaction on the SQL path.
const SQL_BATCH: usize = 20_000;

/// Distinct sealed envelopes reused on the SQL path.
const POOL: usize = 256;

/// 14 days (the default retention), ms.
const RETENTION_MS: i64 = 14 * 86_400_000;

/// What seeding took.
pub struct Seeded {
    /// Items written in all.
    pub items: usize,
    /// Wall time, s.
    pub seconds: f64,
    /// Items through the API and their seconds.
    pub api: (usize, f64),
    /// Items through SQL and their seconds.
    pub sql: (usize, f64),
    /// How the items were written.
    pub method: String,
}

impl Seeded {
    /// Items per second over the whole seeding.
    pub fn items_per_s(&self) -> f64 {
        self.items as f64 / self.seconds.max(1e-9)
    }

    /// One line for the progress output.
    pub fn describe(&self) -> String {
        format!(
            "seeded {} items in {:.1} s ({} via SqliteStore::push at {:.0}/s of push time, {} via SQL at {:.0}/s)",
            self.items,
            self.seconds,
            self.api.0,
            self.api.0 as f64 / self.api.1.max(1e-9),
            self.sql.0,
            self.sql.0 as f64 / self.sql.1.max(1e-9)
        )
    }
}

fn limits() -> StoreLimits {
    StoreLimits {
        max_queue_items: 100_000_000,
        max_queue_bytes: 1_000_000_000_000,
        max_sender_items: 100_000_000,
        max_sender_bytes: 1_000_000_000_000,
        max_owner_items: 100_000_000,
        max_owner_bytes: 1_000_000_000_000,
        ..StoreLimits::default()
    }
}

fn open(dir: &Path, key: &HostKey) -> Res<SqliteStore> {
    let options = OpenOptions {
        lock_wait_ms: 0,
        failpoint: store::no_failpoint,
        limits: limits(),
    };
    SqliteStore::open_with(dir, &key.public().to_b64(), now_ms(), options)
        .map_err(|e| format!("open the store: {e}"))
}

/// Enrols `sender` and every queue's target in `dir` (relay key `key`) and queues `n` sealed
/// items from `sender` for each `(target, n)`.
pub fn seed(
    dir: &Path,
    key: &HostKey,
    sender: &Host,
    queues: &[(&Host, usize)],
    body_len: usize,
) -> Res<Seeded> {
    let t0 = Instant::now();
    let st = open(dir, key)?;
    for h in std::iter::once(sender).chain(queues.iter().map(|(h, _)| *h)) {
        let out = st
            .enrol(EnrolRequest {
                host_pubkey: h.pubkey(),
                host_name: h.name.clone(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".into(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: now_ms(),
            })
            .map_err(|e| format!("enrol: {e}"))?;
        if !matches!(out, EnrolOutcome::Enrolled(_)) {
            return Err(format!("enrol {}: {out:?}", h.name));
        }
    }
    let mut ids = ulid::Generator::new();
    // 1. The store API (only the `push` calls are timed, not building the envelopes).
    let mut api_secs = 0.0;
    let mut api_items = 0;
    for (target, n) in queues {
        let mut left = (*n).min(API_ITEMS);
        while left > 0 {
            let k = left.min(API_BATCH);
            let items = (0..k)
                .map(|_| {
                    let (id, wire) = sealed(sender, target, body_len, &mut ids);
                    PushItem {
                        kind: "envelope".into(),
                        item_id: id,
                        targets: vec![PushTarget {
                            target_pubkey: target.pubkey(),
                            wire: wire.into(),
                        }],
                    }
                })
                .collect();
            let ta = Instant::now();
            let out = st
                .push(PushBatch {
                    sender_pubkey: sender.pubkey(),
                    sender_host: sender.name.clone(),
                    now_ms: now_ms(),
                    expiry: Expiry::Retention,
                    items,
                })
                .map_err(|e| format!("push: {e}"))?;
            api_secs += ta.elapsed().as_secs_f64();
            if let Some(bad) = out
                .items
                .iter()
                .find(|i| !matches!(i.status, ItemStatus::Accepted))
            {
                return Err(format!("seed push refused: {bad:?}"));
            }
            left -= k;
            api_items += k;
        }
    }
    st.close().map_err(|e| format!("close the store: {e}"))?;

    // 2. Plain INSERTs in the store's schema.
    let ts = Instant::now();
    let mut sql_items = 0;
    let mut conn = rusqlite::Connection::open(dir.join(store::DB_FILE))
        .map_err(|e| format!("open relay.db: {e}"))?;
    conn.execute_batch("PRAGMA cache_size = -262144;")
        .map_err(|e| e.to_string())?;
    let sender_pk = sender.pubkey();
    for (target, n) in queues {
        let rest = n.saturating_sub(API_ITEMS);
        if rest == 0 {
            continue;
        }
        let pool: Vec<(Vec<u8>, String)> = (0..POOL)
            .map(|_| {
                let (_, wire) = sealed(sender, target, body_len, &mut ids);
                let hash = agentmbx_protocol::hash::sha256_hex(&wire);
                (wire, hash)
            })
            .collect();
        let tpk = target.pubkey();
        let mut done = 0;
        while done < rest {
            let k = (rest - done).min(SQL_BATCH);
            let now = now_ms();
            let tx = conn.transaction().map_err(|e| e.to_string())?;
            {
                let next: i64 = tx
                    .query_row(
                        "SELECT COALESCE((SELECT next_seq FROM seqs WHERE target_pubkey = ?1), 1)",
                        [&tpk],
                        |r| r.get(0),
                    )
                    .map_err(|e| e.to_string())?;
                let mut seq = next.max(now).max(1);
                let mut ins_item = tx
                    .prepare(
                        "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                                            wire, wire_hash, bytes, accepted_at, expires_at)
                         VALUES (?1, ?2, 'envelope', ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                    )
                    .map_err(|e| e.to_string())?;
                let mut ins_dedup = tx
                    .prepare(
                        "INSERT INTO dedup (sender_pubkey, item_id, target_pubkey, wire_hash, seq, accepted_at)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    )
                    .map_err(|e| e.to_string())?;
                for i in 0..k {
                    let (wire, hash) = &pool[(done + i) % POOL];
                    let id = ids.next(now);
                    ins_item
                        .execute(params![
                            tpk,
                            seq,
                            id,
                            sender_pk,
                            sender.name,
                            wire,
                            hash,
                            wire.len() as i64,
                            now,
                            now + RETENTION_MS
                        ])
                        .map_err(|e| e.to_string())?;
                    ins_dedup
                        .execute(params![sender_pk, id, tpk, hash, seq, now])
                        .map_err(|e| e.to_string())?;
                    seq += 1;
                }
                tx.execute(
                    "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, ?2)
                     ON CONFLICT(target_pubkey) DO UPDATE SET next_seq = excluded.next_seq",
                    params![tpk, seq],
                )
                .map_err(|e| e.to_string())?;
            }
            tx.commit().map_err(|e| e.to_string())?;
            done += k;
            sql_items += k;
            if sql_items % 200_000 < SQL_BATCH {
                eprintln!("bench relay: seeded {sql_items} items via SQL…");
            }
        }
    }
    conn.close().map_err(|(_, e)| e.to_string())?;
    let sql_secs = ts.elapsed().as_secs_f64();

    // 3. Open again through the API: consistency, heartbeat.
    let st = open(dir, key)?;
    for (target, n) in queues {
        let info = st
            .info_for(&target.pubkey())
            .map_err(|e| format!("info: {e}"))?;
        if *n > 0 && info.head_seq <= 0 {
            return Err(format!("the seeded queue of {} is empty", target.name));
        }
    }
    st.set_heartbeat(now_ms())
        .map_err(|e| format!("heartbeat: {e}"))?;
    st.close().map_err(|e| format!("close the store: {e}"))?;
    Ok(Seeded {
        items: api_items + sql_items,
        seconds: t0.elapsed().as_secs_f64(),
        api: (api_items, api_secs),
        sql: (sql_items, sql_secs),
        method: format!(
            "first {API_ITEMS} items per queue via SqliteStore::push ({API_BATCH}-item batches), \
             the rest via INSERTs in the store schema ({SQL_BATCH} items per transaction, \
             {POOL} distinct sealed wires reused under fresh ids)"
        ),
    })
}
