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
//! Since version 4 the schema holds triggers: the usage counters of [`V4`] are kept by SQLite
//! itself on every write to `items`, so no code path (push, ack, sweep, rotation, restore, a
//! direct insert) can leave them stale. Restore accepts a backup only when its objects,
//! triggers included, are exactly this binary's for the backup's version.
//!
//! This schema is ours (the Rust relay's versions 1 to 4); it is not 0.5.x's `relay.db`
//! numbering.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use crate::store::StoreError;

/// The newest schema version this binary reads and writes.
pub const SCHEMA_VERSION: u32 = 4;

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

/// The statements that fill the (empty) usage tables of [`V4`] from `items`: the migration's
/// backfill, and [`rebuild_usage`] after emptying them.
macro_rules! usage_backfill {
    () => {
        "
INSERT INTO target_usage (target_pubkey, items, bytes)
  SELECT target_pubkey, COUNT(*), SUM(bytes) FROM items GROUP BY target_pubkey;
INSERT INTO sender_usage (sender_pubkey, target_pubkey, items, bytes)
  SELECT sender_pubkey, target_pubkey, COUNT(*), SUM(bytes) FROM items
   GROUP BY sender_pubkey, target_pubkey;
"
    };
}

/// Version 4: usage counters, so every quota check of a push reads one row instead of the
/// target's whole queue (`wire.md` §3.2 quotas).
/// - `target_usage`: per target key, the items queued under it and their wire bytes.
/// - `sender_usage`: the same per (sender key, target key), for the sender share.
/// - Both are backfilled from `items` here and kept exact by the `items_usage_*` triggers on
///   every insert, delete and update of an item's keys or size (a rotation moves a queue with
///   an insert and a delete). A row whose count reaches 0 is deleted, so the tables hold only
///   the queues that exist. The account quota sums `target_usage` over the account's live
///   enrolments.
/// - `items_sender` is dropped: it only served the per-sender quota sum, which the counters now
///   answer, and every item written paid for it.
const V4: &str = concat!(
    "
CREATE TABLE target_usage (
  target_pubkey TEXT PRIMARY KEY NOT NULL,
  items         INTEGER NOT NULL,
  bytes         INTEGER NOT NULL
) STRICT, WITHOUT ROWID;

CREATE TABLE sender_usage (
  sender_pubkey TEXT NOT NULL,
  target_pubkey TEXT NOT NULL,
  items         INTEGER NOT NULL,
  bytes         INTEGER NOT NULL,
  PRIMARY KEY (sender_pubkey, target_pubkey)
) STRICT, WITHOUT ROWID;
",
    usage_backfill!(),
    "
DROP INDEX items_sender;

CREATE TRIGGER items_usage_insert AFTER INSERT ON items BEGIN
  INSERT INTO target_usage (target_pubkey, items, bytes) VALUES (new.target_pubkey, 1, new.bytes)
    ON CONFLICT (target_pubkey) DO UPDATE
      SET items = items + 1, bytes = bytes + excluded.bytes;
  INSERT INTO sender_usage (sender_pubkey, target_pubkey, items, bytes)
    VALUES (new.sender_pubkey, new.target_pubkey, 1, new.bytes)
    ON CONFLICT (sender_pubkey, target_pubkey) DO UPDATE
      SET items = items + 1, bytes = bytes + excluded.bytes;
END;

CREATE TRIGGER items_usage_delete AFTER DELETE ON items BEGIN
  DELETE FROM target_usage WHERE target_pubkey = old.target_pubkey AND items <= 1;
  UPDATE target_usage SET items = items - 1, bytes = bytes - old.bytes
   WHERE target_pubkey = old.target_pubkey;
  DELETE FROM sender_usage
   WHERE sender_pubkey = old.sender_pubkey AND target_pubkey = old.target_pubkey AND items <= 1;
  UPDATE sender_usage SET items = items - 1, bytes = bytes - old.bytes
   WHERE sender_pubkey = old.sender_pubkey AND target_pubkey = old.target_pubkey;
END;

CREATE TRIGGER items_usage_update AFTER UPDATE OF target_pubkey, sender_pubkey, bytes ON items
BEGIN
  DELETE FROM target_usage WHERE target_pubkey = old.target_pubkey AND items <= 1;
  UPDATE target_usage SET items = items - 1, bytes = bytes - old.bytes
   WHERE target_pubkey = old.target_pubkey;
  DELETE FROM sender_usage
   WHERE sender_pubkey = old.sender_pubkey AND target_pubkey = old.target_pubkey AND items <= 1;
  UPDATE sender_usage SET items = items - 1, bytes = bytes - old.bytes
   WHERE sender_pubkey = old.sender_pubkey AND target_pubkey = old.target_pubkey;
  INSERT INTO target_usage (target_pubkey, items, bytes) VALUES (new.target_pubkey, 1, new.bytes)
    ON CONFLICT (target_pubkey) DO UPDATE
      SET items = items + 1, bytes = bytes + excluded.bytes;
  INSERT INTO sender_usage (sender_pubkey, target_pubkey, items, bytes)
    VALUES (new.sender_pubkey, new.target_pubkey, 1, new.bytes)
    ON CONFLICT (sender_pubkey, target_pubkey) DO UPDATE
      SET items = items + 1, bytes = bytes + excluded.bytes;
END;
"
);

/// Every schema step, `(version it produces, DDL)`, in increasing order without gaps. Step N
/// turns a version N−1 store into version N.
pub const MIGRATIONS: &[(u32, &str)] = &[(1, V1), (2, V2), (3, V3), (4, V4)];

/// Recomputes the usage counters of a version 4 (or later) store from its `items`, in the
/// caller's transaction: restore runs it on a backup, whose counters are data like any other
/// and are not trusted. Errors: SQLite errors.
pub(crate) fn rebuild_usage(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch(concat!(
        "DELETE FROM target_usage; DELETE FROM sender_usage;",
        usage_backfill!()
    ))?;
    Ok(())
}

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

/// Test helper: panics unless the usage counters equal a fresh `GROUP BY` over `items` (and no
/// counter row is empty); returns how many items the counters hold in all.
#[cfg(test)]
#[allow(clippy::expect_used)]
pub(crate) fn assert_usage_matches(conn: &Connection) -> i64 {
    let rows = |sql: &str| -> Vec<(String, String, i64, i64)> {
        let mut st = conn.prepare(sql).expect(sql);
        let out = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .expect(sql)
            .collect::<Result<Vec<_>, _>>()
            .expect(sql);
        out
    };
    let targets = rows("SELECT target_pubkey, '', items, bytes FROM target_usage ORDER BY 1");
    let want =
        rows("SELECT target_pubkey, '', COUNT(*), SUM(bytes) FROM items GROUP BY 1 ORDER BY 1");
    assert_eq!(targets, want, "target_usage differs from items");
    let senders =
        rows("SELECT sender_pubkey, target_pubkey, items, bytes FROM sender_usage ORDER BY 1, 2");
    let want = rows(
        "SELECT sender_pubkey, target_pubkey, COUNT(*), SUM(bytes) FROM items
         GROUP BY 1, 2 ORDER BY 1, 2",
    );
    assert_eq!(senders, want, "sender_usage differs from items");
    targets.iter().map(|t| t.2).sum()
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
            "target_usage",
            "sender_usage",
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

    /// Inserts an item row of `bytes` bytes.
    fn item(conn: &Connection, target: &str, seq: i64, sender: &str, bytes: i64) {
        conn.execute(
            "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                                wire, wire_hash, bytes, accepted_at, expires_at)
             VALUES (?1, ?2, 'envelope', ?3, ?4, 'h', x'00', 'hash', ?5, 1, NULL)",
            rusqlite::params![target, seq, format!("i{seq}"), sender, bytes],
        )
        .expect("item");
    }

    fn usage_rows(conn: &Connection, table: &str) -> i64 {
        conn.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
            .expect("count")
    }

    #[test]
    fn version_4_backfills_the_usage_counters_of_a_version_3_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut conn = open(dir.path());
        migrate(&mut conn, 0, 3, MIGRATIONS).expect("to 3");
        for (target, seq, sender, bytes) in [
            ("t1", 1, "s1", 100),
            ("t1", 2, "s1", 50),
            ("t1", 3, "s2", 7),
            ("t2", 1, "s1", 1_000),
        ] {
            item(&conn, target, seq, sender, bytes);
        }
        migrate(&mut conn, 3, SCHEMA_VERSION, MIGRATIONS).expect("to current");
        assert_eq!(assert_usage_matches(&conn), 4);
        let t1: (i64, i64) = conn
            .query_row(
                "SELECT items, bytes FROM target_usage WHERE target_pubkey = 't1'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("t1");
        assert_eq!(t1, (3, 157));
        let s1t1: (i64, i64) = conn
            .query_row(
                "SELECT items, bytes FROM sender_usage
                 WHERE sender_pubkey = 's1' AND target_pubkey = 't1'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("s1 t1");
        assert_eq!(s1t1, (2, 150));
        let index: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM sqlite_master WHERE name = 'items_sender'",
                [],
                |r| r.get(0),
            )
            .expect("index");
        assert_eq!(index, 0, "the quota index is gone");
    }

    #[test]
    fn the_triggers_keep_the_counters_exact_and_drop_empty_rows() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut conn = open(dir.path());
        migrate(&mut conn, 0, SCHEMA_VERSION, MIGRATIONS).expect("migrate");
        assert_eq!(assert_usage_matches(&conn), 0);
        item(&conn, "t1", 1, "s1", 10);
        item(&conn, "t1", 2, "s2", 20);
        item(&conn, "t2", 1, "s1", 30);
        assert_eq!(assert_usage_matches(&conn), 3);
        // A move to another key and sender, and a size change, as one update each.
        conn.execute(
            "UPDATE items SET target_pubkey = 't3', sender_pubkey = 's3' WHERE target_pubkey = 't2'",
            [],
        )
        .expect("move");
        conn.execute(
            "UPDATE items SET bytes = 11 WHERE seq = 1 AND target_pubkey = 't1'",
            [],
        )
        .expect("resize");
        // An update of another column leaves them alone.
        conn.execute("UPDATE items SET kind = 'receipt'", [])
            .expect("kind");
        assert_eq!(assert_usage_matches(&conn), 3);
        assert_eq!(
            usage_rows(&conn, "target_usage"),
            2,
            "t2's row went with its last item"
        );
        conn.execute(
            "DELETE FROM items WHERE target_pubkey = 't1' AND seq = 1",
            [],
        )
        .expect("delete one");
        assert_eq!(assert_usage_matches(&conn), 2);
        conn.execute("DELETE FROM items", []).expect("delete all");
        assert_eq!(assert_usage_matches(&conn), 0);
        assert_eq!(usage_rows(&conn, "target_usage"), 0);
        assert_eq!(usage_rows(&conn, "sender_usage"), 0);
        // Recomputing from scratch gives the same counters the triggers kept.
        item(&conn, "t1", 5, "s1", 5);
        conn.execute("UPDATE target_usage SET items = 99", [])
            .expect("spoil");
        rebuild_usage(&conn).expect("rebuild");
        assert_eq!(assert_usage_matches(&conn), 1);
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
