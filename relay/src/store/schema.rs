//! `relay.db` schema and migrations (spec §2 "meta", `wire.md` §3.3).
//!
//! The version lives in two places that are written together: `PRAGMA user_version` and
//! `meta.schema_version`. A store reads the higher of the two. A newer store is refused
//! ([`StoreError::SchemaTooNew`]); an older one runs every missing step of [`MIGRATIONS`] in
//! order inside ONE transaction, so a crash leaves either the old or the new schema, never a mix.
//! Migrations never touch `meta.epoch`: a migration is not a restore (spec §2).
//!
//! Adding a version: append `(N, "DDL…")` to [`MIGRATIONS`] and raise [`SCHEMA_VERSION`] to N.
//! Version 0 is an empty file.
//!
//! This schema is ours (the Rust relay's versions 1 to 3); it is not 0.5.x's `relay.db`
//! numbering.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use super::StoreError;

/// The newest schema version this binary reads and writes.
pub const SCHEMA_VERSION: u32 = 3;

/// Version 1: every table of `wire.md` §3.3. Deviations, each for a reason:
/// - `enrolments.authority_rank`: the strength of the authority that recorded `account`, so a
///   weaker one never overwrites it (spec §2).
/// - `enc_ad_records.enc_pub`: the key inside the record, so lookups need not parse JSON.
/// - `items_sender` also covers `bytes`, so the per-sender quota sum reads the index only.
/// - Times are integer ms; `STRICT` tables make SQLite enforce the column types.
const V1: &str = "
CREATE TABLE meta (
  k TEXT PRIMARY KEY NOT NULL,
  v TEXT NOT NULL
) STRICT;

CREATE TABLE enrolments (
  host_pubkey    TEXT PRIMARY KEY NOT NULL,
  host_name      TEXT NOT NULL,
  owner_fp       TEXT NOT NULL,
  account        TEXT,
  authorized_by  TEXT NOT NULL,
  authority_rank INTEGER NOT NULL DEFAULT 0,
  enrolled_at    INTEGER NOT NULL,
  revoked_at     INTEGER
) STRICT;
CREATE INDEX enrolments_live_name ON enrolments(lower(host_name)) WHERE revoked_at IS NULL;
CREATE UNIQUE INDEX enrolments_account_name ON enrolments(account, lower(host_name))
  WHERE revoked_at IS NULL AND account IS NOT NULL;

CREATE TABLE enc_ads (
  host_pubkey TEXT PRIMARY KEY NOT NULL,
  host_name   TEXT NOT NULL,
  enc_pub     TEXT NOT NULL,
  sig         TEXT NOT NULL,
  at          INTEGER NOT NULL
) STRICT;

CREATE TABLE enc_ad_records (
  host_pubkey TEXT PRIMARY KEY NOT NULL,
  enc_pub     TEXT NOT NULL,
  record      TEXT NOT NULL,
  sig         TEXT NOT NULL,
  at          INTEGER NOT NULL
) STRICT;

CREATE TABLE items (
  target_pubkey TEXT NOT NULL,
  seq           INTEGER NOT NULL,
  kind          TEXT NOT NULL,
  item_id       TEXT NOT NULL,
  sender_pubkey TEXT NOT NULL,
  sender_host   TEXT NOT NULL,
  wire          BLOB NOT NULL,
  wire_hash     TEXT NOT NULL,
  bytes         INTEGER NOT NULL,
  accepted_at   INTEGER NOT NULL,
  expires_at    INTEGER,
  PRIMARY KEY (target_pubkey, seq)
) STRICT;
CREATE INDEX items_expiry ON items(expires_at);
CREATE INDEX items_sender ON items(sender_pubkey, target_pubkey, bytes);

CREATE TABLE dedup (
  sender_pubkey TEXT NOT NULL,
  item_id       TEXT NOT NULL,
  target_pubkey TEXT NOT NULL,
  wire_hash     TEXT NOT NULL,
  seq           INTEGER NOT NULL,
  accepted_at   INTEGER NOT NULL,
  PRIMARY KEY (sender_pubkey, item_id, target_pubkey)
) STRICT;
CREATE INDEX dedup_age ON dedup(accepted_at);

CREATE TABLE seqs (
  target_pubkey TEXT PRIMARY KEY NOT NULL,
  next_seq      INTEGER NOT NULL
) STRICT;

CREATE TABLE acked (
  target_pubkey TEXT PRIMARY KEY NOT NULL,
  acked_through INTEGER NOT NULL
) STRICT;

CREATE TABLE sender_lists (
  target_pubkey TEXT PRIMARY KEY NOT NULL,
  senders       TEXT NOT NULL,
  iat           INTEGER NOT NULL,
  record        TEXT NOT NULL,
  sig           TEXT NOT NULL
) STRICT;

CREATE TABLE ops (
  id      INTEGER PRIMARY KEY AUTOINCREMENT,
  at      INTEGER NOT NULL,
  op      TEXT NOT NULL,
  receipt TEXT NOT NULL
) STRICT;
";

/// Version 2: the enrolment authorities (spec §8).
/// - `deny`: the deny-list, keyed by host fingerprint (`kind = 'host'`) or token `client_id`
///   (`kind = 'client'`); `until` in ms, NULL for "until removed". Kept in the store (not in
///   memory) so it survives a restart and travels with backups.
/// - `account_bindings`: what the account authority proved at enrolment — the certified cloud
///   key's thumbprint every later hop token must be bound to, the token's `client_id`, `sub`
///   and `org` — one row per enrolled key, written in the enrolment's transaction.
const V2: &str = "
CREATE TABLE deny (
  kind  TEXT NOT NULL CHECK (kind IN ('host', 'client')),
  value TEXT NOT NULL,
  until INTEGER,
  at    INTEGER NOT NULL,
  PRIMARY KEY (kind, value)
) STRICT;

CREATE TABLE account_bindings (
  host_pubkey TEXT PRIMARY KEY NOT NULL,
  cloud_jkt   TEXT NOT NULL,
  client_id   TEXT NOT NULL,
  sub         TEXT NOT NULL,
  org         TEXT,
  at          INTEGER NOT NULL
) STRICT;
";

/// Version 3: the retention sweep (spec §6; `wire.md` §3.2 "Sweep").
/// - `items.origin_target`: the target key the sender pushed an item to, set when a host
///   rotation moved the item to a newer key (NULL: the item waits under that very key). The
///   sweep names it in the expiry notice (the sender matches its outbox row by it) and keeps
///   the item's dedup row — which stays under that key — while the item is queued.
/// - Items a rotation already moved under version 2 get it from their dedup row: the one row
///   of the same sender, item id and wire hash under another key (a copy sealed for another
///   target has another hash), when the item has none under its own key.
/// - `items_origin`: finds a moved item by its original key; partial, so it costs nothing for
///   the items no rotation moved.
const V3: &str = "
ALTER TABLE items ADD COLUMN origin_target TEXT;
UPDATE items SET origin_target = (
    SELECT d.target_pubkey FROM dedup d
     WHERE d.sender_pubkey = items.sender_pubkey AND d.item_id = items.item_id
       AND d.wire_hash = items.wire_hash AND d.target_pubkey <> items.target_pubkey
     ORDER BY d.accepted_at, d.target_pubkey
     LIMIT 1)
 WHERE NOT EXISTS (SELECT 1 FROM dedup d
                    WHERE d.sender_pubkey = items.sender_pubkey AND d.item_id = items.item_id
                      AND d.target_pubkey = items.target_pubkey);
CREATE INDEX items_origin ON items(origin_target, sender_pubkey, item_id)
  WHERE origin_target IS NOT NULL;
";

/// Every schema step, `(version it produces, DDL)`, in increasing order without gaps. Step N
/// turns a version N−1 store into version N.
pub const MIGRATIONS: &[(u32, &str)] = &[(1, V1), (2, V2), (3, V3)];

/// The schema version recorded in an open database: the higher of `PRAGMA user_version` and
/// `meta.schema_version` (0 for an empty file).
pub(crate) fn stored_version(conn: &Connection) -> Result<u32, StoreError> {
    let user_version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    let user_version = u32::try_from(user_version)
        .map_err(|_| StoreError::Corrupt(format!("user_version {user_version} is out of range")))?;
    let has_meta: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta')",
        [],
        |r| r.get(0),
    )?;
    let meta_version = if has_meta {
        let v: Option<String> = conn
            .query_row("SELECT v FROM meta WHERE k = 'schema_version'", [], |r| {
                r.get(0)
            })
            .optional()?;
        match v {
            Some(v) => v.trim().parse::<u32>().map_err(|_| {
                StoreError::Corrupt(format!("meta.schema_version {v:?} is not a version number"))
            })?,
            None => 0,
        }
    } else {
        0
    };
    Ok(user_version.max(meta_version))
}

/// Bring a database from version `found` to `target` with the steps of `migrations`, all in one
/// `BEGIN IMMEDIATE` transaction; record the new version in `user_version` and
/// `meta.schema_version`. On any error nothing changes. Never touches the epoch.
///
/// Errors: [`StoreError::SchemaTooNew`] if `found > target`, [`StoreError::Corrupt`] if the
/// steps do not lead from `found` to `target` one version at a time, SQLite errors from the DDL.
pub(crate) fn migrate(
    conn: &mut Connection,
    found: u32,
    target: u32,
    migrations: &[(u32, &str)],
) -> Result<(), StoreError> {
    if found > target {
        return Err(StoreError::SchemaTooNew {
            found,
            supported: target,
        });
    }
    if found == target {
        return Ok(());
    }
    let steps: Vec<&(u32, &str)> = migrations
        .iter()
        .filter(|(v, _)| *v > found && *v <= target)
        .collect();
    let contiguous = steps
        .iter()
        .enumerate()
        .all(|(i, (v, _))| u64::from(*v) == u64::from(found) + 1 + i as u64);
    if !contiguous || steps.len() as u64 != u64::from(target - found) {
        return Err(StoreError::Corrupt(format!(
            "no migration path from schema version {found} to {target}"
        )));
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    for (version, ddl) in steps {
        tx.execute_batch(ddl).map_err(|e| {
            tracing::error!(version, error = %e, "relay store migration step failed");
            StoreError::Sqlite(e)
        })?;
    }
    // `target` is a u32 we own, never user text: formatting it into the pragma is safe.
    tx.execute_batch(&format!("PRAGMA user_version = {target}"))?;
    tx.execute(
        "INSERT INTO meta (k, v) VALUES ('schema_version', ?1)
         ON CONFLICT(k) DO UPDATE SET v = excluded.v",
        [target.to_string()],
    )?;
    tx.commit()?;
    tracing::info!(from = found, to = target, "relay store schema migrated");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &std::path::Path) -> Connection {
        Connection::open(dir.join("m.db")).expect("open")
    }

    fn tables(conn: &Connection) -> Vec<String> {
        let mut st = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .expect("prepare");
        let rows = st
            .query_map([], |r| r.get::<_, String>(0))
            .expect("query")
            .collect::<Result<Vec<_>, _>>()
            .expect("rows");
        rows
    }

    fn user_version(conn: &Connection) -> i64 {
        conn.query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("user_version")
    }

    #[test]
    fn fresh_database_is_version_zero_and_migrates_to_current() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut conn = open(dir.path());
        assert_eq!(stored_version(&conn).expect("version"), 0);
        migrate(&mut conn, 0, SCHEMA_VERSION, MIGRATIONS).expect("migrate");
        assert_eq!(stored_version(&conn).expect("version"), SCHEMA_VERSION);
        assert_eq!(user_version(&conn), i64::from(SCHEMA_VERSION));
        let t = tables(&conn);
        for name in [
            "account_bindings",
            "acked",
            "dedup",
            "deny",
            "enc_ad_records",
            "enc_ads",
            "enrolments",
            "items",
            "meta",
            "ops",
            "sender_lists",
            "seqs",
        ] {
            assert!(t.iter().any(|x| x == name), "missing table {name}: {t:?}");
        }
    }

    #[test]
    fn a_later_step_runs_in_order_and_keeps_the_epoch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut conn = open(dir.path());
        migrate(&mut conn, 0, 1, MIGRATIONS).expect("to 1");
        conn.execute("INSERT INTO meta (k, v) VALUES ('epoch', 'e-1')", [])
            .expect("epoch");
        conn.execute(
            "INSERT INTO seqs (target_pubkey, next_seq) VALUES ('t', 42)",
            [],
        )
        .expect("seq");
        // Steps 2 (the real one) and a further test step run in order over a version 1 store.
        let next = SCHEMA_VERSION + 1;
        let with_next: Vec<(u32, &str)> = MIGRATIONS
            .iter()
            .copied()
            .chain([(
                next,
                "ALTER TABLE seqs ADD COLUMN note TEXT; CREATE TABLE extra (x INTEGER) STRICT;",
            )])
            .collect();
        let found = stored_version(&conn).expect("version");
        assert_eq!(found, 1);
        migrate(&mut conn, found, next, &with_next).expect("to next");
        assert_eq!(stored_version(&conn).expect("version"), next);
        assert_eq!(user_version(&conn), i64::from(next));
        let epoch: String = conn
            .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| r.get(0))
            .expect("epoch");
        assert_eq!(epoch, "e-1", "a migration keeps the epoch");
        let next: i64 = conn
            .query_row(
                "SELECT next_seq FROM seqs WHERE target_pubkey = 't'",
                [],
                |r| r.get(0),
            )
            .expect("seq");
        assert_eq!(next, 42, "data survives");
        let t = tables(&conn);
        assert!(t.iter().any(|t| t == "extra"), "{t:?}");
        assert!(t.iter().any(|t| t == "deny"), "step 2 ran: {t:?}");
    }

    #[test]
    fn a_failing_step_leaves_the_old_version_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut conn = open(dir.path());
        migrate(&mut conn, 0, 1, MIGRATIONS).expect("to 1");
        let broken: Vec<(u32, &str)> = MIGRATIONS
            .iter()
            .copied()
            .chain([
                (SCHEMA_VERSION + 1, "CREATE TABLE fine (x INTEGER);"),
                (SCHEMA_VERSION + 2, "THIS IS NOT SQL;"),
            ])
            .collect();
        assert!(matches!(
            migrate(&mut conn, 1, SCHEMA_VERSION + 2, &broken),
            Err(StoreError::Sqlite(_))
        ));
        assert_eq!(stored_version(&conn).expect("version"), 1);
        let t = tables(&conn);
        assert!(
            !t.iter().any(|t| t == "fine" || t == "deny"),
            "every step was rolled back with the failing one: {t:?}"
        );
    }

    #[test]
    fn gaps_and_downgrades_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut conn = open(dir.path());
        let gap: Vec<(u32, &str)> = vec![(1, V1), (3, "SELECT 1;")];
        assert!(matches!(
            migrate(&mut conn, 0, 3, &gap),
            Err(StoreError::Corrupt(_))
        ));
        let gap: Vec<(u32, &str)> = vec![(1, V1), (2, V2), (4, "SELECT 1;")];
        assert!(matches!(
            migrate(&mut conn, 0, 4, &gap),
            Err(StoreError::Corrupt(_))
        ));
        assert_eq!(stored_version(&conn).expect("version"), 0);
        assert!(matches!(
            migrate(&mut conn, 5, SCHEMA_VERSION, MIGRATIONS),
            Err(StoreError::SchemaTooNew {
                found: 5,
                supported: SCHEMA_VERSION
            })
        ));
    }
}
