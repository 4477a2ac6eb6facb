//! `mailbox.db` schema and migrations, driven by `PRAGMA user_version`.

use rusqlite::Connection;

use super::MailboxError;

/// The schema version this binary writes.
pub const SCHEMA_VERSION: u32 = 1;

/// Migrations in order: `(version reached, SQL)`. A new schema change appends a step; each
/// step runs inside the one migration transaction.
const MIGRATIONS: &[(u32, &str)] = &[(
    1,
    r#"
CREATE TABLE kv(k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE messages(
  id TEXT PRIMARY KEY, ts TEXT NOT NULL, from_addr TEXT NOT NULL, thread TEXT NOT NULL,
  reply_to TEXT, kind TEXT NOT NULL, subject TEXT NOT NULL, body TEXT NOT NULL,
  envelope TEXT NOT NULL, origin TEXT NOT NULL, received_at INTEGER NOT NULL);
CREATE TABLE deliveries(
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  msg_id TEXT NOT NULL REFERENCES messages(id), agent TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('new','read','acked')),
  updated_at INTEGER NOT NULL, note TEXT, UNIQUE(msg_id, agent));
CREATE INDEX deliveries_agent ON deliveries(agent, seq);
CREATE TABLE peers(
  host TEXT PRIMARY KEY, pubkey TEXT NOT NULL UNIQUE, enc_pub TEXT, enc_ad_iat INTEGER,
  added_at INTEGER NOT NULL);
CREATE TABLE outbox(
  msg_id TEXT NOT NULL REFERENCES messages(id), host TEXT NOT NULL, target_pubkey TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('pending','relay-accepted','rejected','delivered')),
  attempts INTEGER NOT NULL DEFAULT 0, next_at INTEGER NOT NULL, last_error TEXT,
  created_at INTEGER NOT NULL,
  wire BLOB, wire_hash TEXT,
  relay TEXT, epoch TEXT, seq INTEGER, accept TEXT, accept_sig TEXT, accepted_at INTEGER,
  deadline_at INTEGER, settled_at INTEGER,
  PRIMARY KEY(msg_id, host));
CREATE INDEX outbox_due ON outbox(state, next_at);
CREATE TABLE relay_position(
  relay TEXT PRIMARY KEY, epoch TEXT NOT NULL, received_through INTEGER NOT NULL,
  acked_through INTEGER NOT NULL DEFAULT 0, updated_at INTEGER NOT NULL);
CREATE TABLE quarantine(
  id INTEGER PRIMARY KEY AUTOINCREMENT, relay TEXT NOT NULL, epoch TEXT NOT NULL,
  seq INTEGER NOT NULL, kind TEXT NOT NULL, item_id TEXT NOT NULL, sender_pubkey TEXT NOT NULL,
  reason TEXT NOT NULL, wire BLOB NOT NULL, at INTEGER NOT NULL, UNIQUE(relay, epoch, seq));
CREATE TABLE idempotency(
  key TEXT NOT NULL, scope TEXT NOT NULL, request_hash TEXT NOT NULL, status INTEGER NOT NULL,
  response TEXT NOT NULL, created_at INTEGER NOT NULL, PRIMARY KEY(scope, key));
"#,
)];

/// Brings `conn` to [`SCHEMA_VERSION`] in one transaction; refuses a newer file.
pub(super) fn migrate(conn: &mut Connection) -> Result<(), MailboxError> {
    migrate_with(conn, MIGRATIONS)
}

fn migrate_with(conn: &mut Connection, steps: &[(u32, &str)]) -> Result<(), MailboxError> {
    let supported = steps.last().map_or(0, |s| s.0);
    let found: u32 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if found > supported {
        return Err(MailboxError::SchemaTooNew { found, supported });
    }
    if found == supported {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    for (version, sql) in steps.iter().filter(|s| s.0 > found) {
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", version)?;
    }
    tx.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_schema_is_refused_and_older_migrates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.db");
        let mut c = Connection::open(&path).unwrap();
        migrate(&mut c).unwrap();
        // A next schema step applies on top of version 1, in one transaction.
        let mut steps = MIGRATIONS.to_vec();
        steps.push((2, "ALTER TABLE peers ADD COLUMN note TEXT;"));
        migrate_with(&mut c, &steps).unwrap();
        let v: u32 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, 2);
        // Our binary (version 1) refuses the version-2 file.
        let err = migrate(&mut c).unwrap_err();
        assert!(err.to_string().contains("schema version 2"), "{err}");
    }
}
